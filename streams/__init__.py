"""The Faust app: lifecycle -> registry table; request logs -> hot scores -> planner -> commands."""
