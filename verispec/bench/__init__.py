"""The evaluation harness: datasets, side-by-side runs and reports."""
