from converge.changes import Role
ROLE = Role("weights", lambda v: {}, lambda ctx: iter(()))
