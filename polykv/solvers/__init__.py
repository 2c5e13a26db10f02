"""Solvers: turn a Profile and a budget into a Plan."""
