"""Merge quality on a real small decoder LM (SmolLM2-135M-Instruct): see ``run.py``."""
