"""Pipeline parallelism: schedules as data, a simulator on them, stages and an executor."""

from shardwise.parallel.pipeline.executor import PipelineExecutor
from shardwise.parallel.pipeline.schedule import (
    SCHEDULES,
    Action,
    Kind,
    Schedule,
    build_schedule,
    schedule_from_compute,
)
from shardwise.parallel.pipeline.simulate import ScheduleError, SimResult, simulate
from shardwise.parallel.pipeline.stack import LayerStack
from shardwise.parallel.pipeline.stage import LayerFn, LayerSpec, PipelineModule, Tied

__all__ = [
    "SCHEDULES",
    "Action",
    "Kind",
    "LayerFn",
    "LayerSpec",
    "LayerStack",
    "PipelineExecutor",
    "PipelineModule",
    "Schedule",
    "ScheduleError",
    "SimResult",
    "Tied",
    "build_schedule",
    "schedule_from_compute",
    "simulate",
]
