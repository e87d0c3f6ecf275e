"""The reference pages made from the schemas and the tasks (build.py)."""
