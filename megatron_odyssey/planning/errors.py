"""Errors the planning layer raises for input it cannot plan with.

The CLI turns ``PlanningError`` into a one-line message and exit code 2, so every message must
name the offending value and what would be accepted instead.
"""


class PlanningError(ValueError):
    """Bad cluster, profile, plan or failure set; the message says exactly what and why."""
