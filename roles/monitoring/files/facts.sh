# shellcheck shell=dash
# The monitoring role's facts of a host (roles/monitoring/role.py), a function each.

# the names of the user and of the group whose id is $1, a line each (empty when there is none)
fact_names_of_id() {
  getent passwd "$1" | cut -d: -f1
  getent group "$1" | cut -d: -f1
}
