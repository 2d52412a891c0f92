"""Graph transforms, one per file; pipeline.py holds THE ordered list."""
