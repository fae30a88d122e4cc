"""The pipeline engine: stage builder, schedule IR, lowering and simulation, runtime, tied weights, drawing."""

from mesh3d.pipeline.draw import chrome_trace, draw
from mesh3d.pipeline.lower import LoweredSchedule, lower
from mesh3d.pipeline.catalog import SCHEDULES, build_schedule
from mesh3d.pipeline.schedules import Action, Kind, Schedule, ScheduleError
from mesh3d.pipeline.simulate import SimulationReport, simulate, simulate_schedule

__all__ = [
    "SCHEDULES",
    "Action",
    "Kind",
    "LoweredSchedule",
    "Schedule",
    "ScheduleError",
    "SimulationReport",
    "build_schedule",
    "chrome_trace",
    "draw",
    "lower",
    "simulate",
    "simulate_schedule",
]
