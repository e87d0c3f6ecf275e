# shellcheck shell=dash
# What every script that acts on replicas starts with (serving/replica_ready/__init__.py): `say` (a lost
# link does not stop the script), `now_ms`, and vLLM's key read from the 0600 environment file
# ($ENV_FILE) into a variable and given to curl on its stdin (`auth | curl -K -`): never on a
# command line, never in the environment of a command.
say() { echo "$@" 2>/dev/null; }
now_ms() { echo $(( $(date +%s%N) / 1000000 )); }
key=$(sed -n 's/^VLLM_API_KEY=//p' "$ENV_FILE" 2>/dev/null)
auth() { printf 'header = "Authorization: Bearer %s"\n' "$key"; }
