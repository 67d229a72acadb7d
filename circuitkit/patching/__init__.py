"""Activation patching: exact sweeps (engine), gradient estimates (attribution), results."""
