"""Compiler passes: each rewrites a Relax module; the pipeline runs them in order."""
