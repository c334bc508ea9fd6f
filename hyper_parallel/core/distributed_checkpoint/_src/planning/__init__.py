"""Planning: the planner protocols, the standard planner (who writes and reads which boxes),
its global save plan and leaf conversions, the planner one call uses, the save-plan cache and
staged column bands. Knows layouts and boxes, not files."""
