"""Pipeline parallelism: schedules as data, a simulator on them, stages and an executor."""

from shardwise.pipeline.schedule import SCHEDULES, Action, Kind, Schedule, build_schedule
from shardwise.pipeline.simulate import ScheduleError, SimResult, simulate

__all__ = [
    "SCHEDULES",
    "Action",
    "Kind",
    "Schedule",
    "ScheduleError",
    "SimResult",
    "build_schedule",
    "simulate",
]
