"""Gradients arriving from the backward and their reduction over the data-parallel group."""
