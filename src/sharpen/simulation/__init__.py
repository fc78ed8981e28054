"""A discrete-event simulator of sharpen's RL loop on a cluster (`sharpen simulate`): engines, trainer, weight
sync, environment and reward fleets, sync vs async, colocated vs disaggregated, failures and stragglers.

It models the system from a scenario file; it never imports the trainer, the engines or the loop, and needs only
the standard library (and pydantic for the scenario schema). docs/scaling.md, "Cluster simulator", has the model,
its limits and its validation.
"""

from sharpen.simulation.cluster import SimulationResult, simulate
from sharpen.simulation.report import SimulationReport, build_report, search_split
from sharpen.simulation.scenario import Scenario, ScenarioError, load_scenario, parse_scenario

__all__ = [
    "Scenario",
    "ScenarioError",
    "SimulationReport",
    "SimulationResult",
    "build_report",
    "load_scenario",
    "parse_scenario",
    "search_split",
    "simulate",
]
