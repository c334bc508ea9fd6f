"""Planning: the planner protocols, the save and load planners (who writes and reads which
boxes) and the standard planner doing both, its global save plan and leaf conversions, the
planner one call uses, the save-plan cache and staged column bands. Knows layouts and boxes,
not files."""
