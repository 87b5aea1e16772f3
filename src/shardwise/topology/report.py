"""A topology as text (islands, ranks, the alpha/bandwidth/R² matrices) and as a heat map."""

from __future__ import annotations

from pathlib import Path

from shardwise.topology.model import LinkFit, Topology


def _cell(fit: LinkFit | None, what: str) -> str:
    if fit is None:
        return "-"
    if what == "alpha":
        return f"{fit.alpha_s * 1e6:.0f}"
    if what == "bw":
        return f"{fit.bandwidth_bytes_per_s / 1e9:.3g}"
    return f"{fit.r2:.3f}"


def _matrix(topo: Topology, what: str, title: str) -> list[str]:
    p = topo.world_size
    width = max(8, len(str(p)) + 2)
    lines = [title, " " * 6 + "".join(f"r{j}".rjust(width) for j in range(p))]
    for i in range(p):
        cells = "".join(_cell(topo.fits[i][j], what).rjust(width) for j in range(p))
        lines.append(f"r{i}".ljust(6) + cells)
    return lines


def format_topology(topo: Topology) -> str:
    """Islands, one line per rank, then alpha (us), bandwidth (GB/s) and R² per link."""
    isl = topo.islands()
    nodes = " | ".join(
        f"{topo.ranks[m[0]].node}: ranks {','.join(map(str, m))}" for m in isl["node"]
    )
    lines = [
        f"shardwise topology: {topo.world_size} ranks on {len(isl['node'])} node(s)",
        f"node islands:   {nodes}",
        "nvlink islands: " + " | ".join(",".join(map(str, m)) for m in isl["nvlink"]),
        "",
        f"{'rank':>4} {'node':<12} {'local':>5} {'numa':<6} {'device':<8} {'gpu':<22} cpus",
    ]
    for r in topo.ranks:
        numa = ",".join(map(str, r.numa_nodes)) or "-"
        gpu = f"{r.gpu_name} {r.pci_bus_id}".strip() or "-"
        cpus = _ranges(r.cpus)
        lines.append(
            f"{r.rank:>4} {r.node:<12} {r.local_rank:>5} {numa:<6} {r.device:<8} {gpu:<22} {cpus}"
        )
    sizes = ", ".join(_size(s) for s in topo.sizes)
    lines += ["", f"ping-pong over {sizes}; one-way time = alpha + bytes / bandwidth", ""]
    lines += _matrix(topo, "alpha", "alpha (us)")
    lines += ["", *_matrix(topo, "bw", "bandwidth (GB/s)")]
    lines += ["", *_matrix(topo, "r2", f"R² of the fit (min {topo.min_r2():.3f})")]
    return "\n".join(lines)


def _size(n: int) -> str:
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} B"


def _ranges(cpus: tuple[int, ...]) -> str:
    out: list[tuple[int, int]] = []
    for c in cpus:
        if out and out[-1][1] == c - 1:
            out[-1] = (out[-1][0], c)
        else:
            out.append((c, c))
    return ",".join(f"{a}-{b}" if a != b else f"{a}" for a, b in out) or "-"


def draw_heatmap(topo: Topology, path: str | Path) -> Path:
    """Bandwidth (GB/s) and alpha (us) of every link as two heat maps in one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    p = topo.world_size
    panels = [("bandwidth (GB/s)", "bw", 1e-9), ("alpha (us)", "alpha", 1e6)]
    fig, axes = plt.subplots(1, 2, figsize=(4 + 1.2 * p, 2 + 0.6 * p), squeeze=False)
    for ax, (title, what, scale) in zip(axes[0], panels):
        grid = [
            [
                float("nan")
                if f is None
                else (f.bandwidth_bytes_per_s if what == "bw" else f.alpha_s) * scale
                for f in row
            ]
            for row in topo.fits
        ]
        im = ax.imshow(grid, cmap="viridis")
        ax.set_title(title)
        ax.set_xticks(range(p), [f"r{j}" for j in range(p)])
        ax.set_yticks(range(p), [f"r{i}" for i in range(p)])
        for i in range(p):
            for j in range(p):
                if i != j:
                    ax.text(j, i, f"{grid[i][j]:.3g}", ha="center", va="center", color="w")
        fig.colorbar(im, ax=ax, shrink=0.8)
    fig.suptitle(f"shardwise topology: {p} ranks, min R² {topo.min_r2():.3f}")
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
