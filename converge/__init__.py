"""converge: a small engine that brings hosts to a declared state over SSH.

It knows about inventories, connections, facts, changes, a parallel runner and a
report. It knows nothing about what is being deployed: that lives in roles.
"""
