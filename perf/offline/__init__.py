"""Carrying files to a GPU host without a package registry (README.md beside this file)."""
