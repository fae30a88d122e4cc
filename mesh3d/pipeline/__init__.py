"""The pipeline engine: the stage split, the runtime that runs a rank's lowered actions (P2P,
split backward, tied weights), and, in `schedule/`, the torch-free compiler whose public names
(the IR, the catalog, lowering, the simulator, drawing) are re-exported here:

    IR: Schedule, Action, Kind, ScheduleError; catalog: SCHEDULES, build_schedule
    lowering: lower -> LoweredSchedule; simulator: simulate, simulate_schedule -> SimulationReport
    drawing: draw, chrome_trace
"""

from mesh3d.pipeline.schedule.catalog import SCHEDULES, build_schedule
from mesh3d.pipeline.schedule.draw import chrome_trace, draw
from mesh3d.pipeline.schedule.ir import Action, Kind, Schedule, ScheduleError
from mesh3d.pipeline.schedule.lower import LoweredSchedule, lower
from mesh3d.pipeline.schedule.simulate import SimulationReport, simulate, simulate_schedule

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
