"""Planning: the planner protocols, the standard planner (who writes and reads which boxes),
the save-plan cache and staged column bands. Knows layouts and boxes, not files."""
