"""Benchmarks of the planner: its predictions against measured runs."""
