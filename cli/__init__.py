"""The command line: Invoke's tasks by domain (deploy and verify, day 2, keys), each a
thin function over the library; ``tasks.py`` at the top assembles them."""
