"""Command-line tools: cli, plan, sweep, compare, pairs, reporting."""
