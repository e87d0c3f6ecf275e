#!/bin/sh
# Managed by dgemma-fleet (roles/exporters): edits here are replaced on the next deploy.
# What the node exporter cannot read itself, every DGEMMA_INTERVAL seconds, as Prometheus
# text in DGEMMA_TEXTFILES (its textfile collector reads them at each scrape):
# - each GPU from nvidia-smi, under the names of NVIDIA's DCGM exporter (DCGM_FI_DEV_*, its
#   labels gpu, UUID, device, modelName, Hostname, pci_bus_id), so that dashboards and rules
#   read one set of names whether a host has DCGM or not;
#   (unless DGEMMA_GPUS=0: the host has NVIDIA's DCGM exporter);
# - the free space of the filesystem that holds the weights (DGEMMA_WEIGHTS);
# - each vLLM replica's unit (its state, and how often systemd restarted it) and whether the
#   front door holds it out of service (drained by a roll or a day-2 command, or in maintenance):
#   a replica whose /metrics does not answer is then known to be down on purpose or not.
# Each file is written whole, then renamed: a scrape never reads half of one.
set -u
interval=${DGEMMA_INTERVAL:-10}
dir=${DGEMMA_TEXTFILES:-/var/lib/dgemma/metrics}
weights=${DGEMMA_WEIGHTS:-/srv/models/hf-cache}
# the host's replicas as deploy declared them (serving/replicas.py): index:unit:server, comma-separated
replicas_declared=${DGEMMA_REPLICAS:-}
frontdoor_socket=${DGEMMA_FRONTDOOR_SOCKET:-/run/dgemma-frontdoor/admin.sock}
fields=index,uuid,name,pci.bus_id,driver_version,utilization.gpu,utilization.memory,memory.used,memory.free,memory.total,temperature.gpu,temperature.memory,power.draw,power.limit,clocks.sm,clocks.max.sm,clocks_throttle_reasons.active
host=$(hostname 2>/dev/null || cat /etc/hostname)
mkdir -p "$dir"

gpus() {
  started=$(date +%s.%N)
  out=$(timeout -k 2 "${DGEMMA_NVIDIA_SMI_TIMEOUT:-10}" nvidia-smi --query-gpu="$fields" --format=csv,noheader,nounits 2>&1)
  rc=$?
  ended=$(date +%s.%N)
  printf '%s\n' "$out" | awk -F', *' -v rc="$rc" -v host="$host" -v started="$started" -v ended="$ended" '
    function num(v) { return v ~ /^-?[0-9]+(\.[0-9]+)?$/ }
    function hex(v,   i, n, d) {  # "0x0000000000000001": the bitmask as a number
      n = 0; v = tolower(v); sub(/^0x/, "", v)
      for (i = 1; i <= length(v); i++) { d = index("0123456789abcdef", substr(v, i, 1)) - 1; if (d < 0) return -1; n = n * 16 + d }
      return n
    }
    function esc(v) { gsub(/\\/, "\\\\", v); gsub(/"/, "\\\"", v); return v }
    function put(name, help, value) {
      if (!num(value)) return
      if (!(name in seen)) { seen[name] = 1; order[++count] = name; helps[name] = help }
      lines[name] = lines[name] sprintf("%s{%s} %s\n", name, labels, value)
    }
    rc == 0 && NF >= 17 {
      labels = sprintf("gpu=\"%s\",UUID=\"%s\",device=\"nvidia%s\",modelName=\"%s\",Hostname=\"%s\",pci_bus_id=\"%s\",DCGM_FI_DRIVER_VERSION=\"%s\"",
                       $1, esc($2), $1, esc($3), esc(host), esc($4), esc($5))
      put("DCGM_FI_DEV_GPU_UTIL", "GPU utilization (in %).", $6)
      put("DCGM_FI_DEV_MEM_COPY_UTIL", "Memory utilization (in %).", $7)
      put("DCGM_FI_DEV_FB_USED", "Framebuffer memory used (in MiB).", $8)
      put("DCGM_FI_DEV_FB_FREE", "Framebuffer memory free (in MiB).", $9)
      put("DCGM_FI_DEV_FB_TOTAL", "Framebuffer memory total (in MiB).", $10)
      put("DCGM_FI_DEV_GPU_TEMP", "GPU temperature (in C).", $11)
      put("DCGM_FI_DEV_MEMORY_TEMP", "Memory temperature (in C).", $12)
      put("DCGM_FI_DEV_POWER_USAGE", "Power draw (in W).", $13)
      put("DCGM_FI_DEV_POWER_MGMT_LIMIT", "Power management limit (in W).", $14)
      put("DCGM_FI_DEV_SM_CLOCK", "SM clock frequency (in MHz).", $15)
      put("DCGM_FI_DEV_MAX_SM_CLOCK", "Maximum SM clock frequency (in MHz).", $16)
      if (hex($17) >= 0) put("DCGM_FI_DEV_CLOCKS_EVENT_REASONS", "Current clock event (throttle) reasons, a bitmask.", hex($17))
      gpus++
      next
    }
    rc == 0 && NF > 0 { bad = $0 }
    END {
      for (i = 1; i <= count; i++) { n = order[i]; printf "# HELP %s %s\n# TYPE %s gauge\n%s", n, helps[n], n, lines[n] }
      up = (rc == 0 && gpus > 0 && bad == "") ? 1 : 0
      print "# HELP dgemma_gpu_collector_up Whether nvidia-smi answered the last query (0: it failed, hung or printed what this collector cannot read)."
      print "# TYPE dgemma_gpu_collector_up gauge"
      printf "dgemma_gpu_collector_up %d\n", up
      print "# HELP dgemma_gpu_collector_duration_seconds How long the last nvidia-smi query took."
      print "# TYPE dgemma_gpu_collector_duration_seconds gauge"
      printf "dgemma_gpu_collector_duration_seconds %.3f\n", ended - started
      print "# HELP dgemma_gpu_collector_last_run_timestamp_seconds When the collector last ran."
      print "# TYPE dgemma_gpu_collector_last_run_timestamp_seconds gauge"
      printf "dgemma_gpu_collector_last_run_timestamp_seconds %.3f\n", ended
    }' > "$dir/.gpu.prom.$$" && mv -f "$dir/.gpu.prom.$$" "$dir/gpu.prom"
}

weights_disk() {
  p=$weights
  while [ ! -e "$p" ] && [ "$p" != / ]; do p=$(dirname "$p"); done
  df -PB1 "$p" 2>/dev/null | awk -v path="$weights" 'NR == 2 {
    gsub(/\\/, "\\\\", path); gsub(/"/, "\\\"", path)
    print "# HELP dgemma_weights_filesystem_avail_bytes Free space, for an unprivileged user, of the filesystem that holds the weights."
    print "# TYPE dgemma_weights_filesystem_avail_bytes gauge"
    printf "dgemma_weights_filesystem_avail_bytes{path=\"%s\",mountpoint=\"%s\"} %s\n", path, $6, $4
    print "# HELP dgemma_weights_filesystem_size_bytes Size of the filesystem that holds the weights."
    print "# TYPE dgemma_weights_filesystem_size_bytes gauge"
    printf "dgemma_weights_filesystem_size_bytes{path=\"%s\",mountpoint=\"%s\"} %s\n", path, $6, $2
  }' > "$dir/.weights.prom.$$" && mv -f "$dir/.weights.prom.$$" "$dir/weights.prom"
}

replicas() {
  entries=$(printf '%s' "$replicas_declared" | tr ',' ' ')
  # the front door's servers as its runtime API says them: field 4 the server, field 7 its admin
  # state (0: in service; bits 0x1, 0x2, 0x4, 0x20, 0x40 maintenance, 0x8, 0x10 drain)
  servers=$(echo 'show servers state servers' | curl -sS --max-time 2 --unix-socket "$frontdoor_socket" \
            telnet://localhost 2>/dev/null | awk 'NF >= 7 && $1 !~ /^#/ { print $4, $7 }')
  {
    echo "# HELP dgemma_replica_unit_state Each vLLM replica's unit, by systemd's ActiveState (1: the one it is in)."
    echo "# TYPE dgemma_replica_unit_state gauge"
    for entry in $entries; do
      index=${entry%%:*}; rest=${entry#*:}; unit=${rest%%:*}
      state=$(systemctl show -p ActiveState --value "$unit" 2>/dev/null)
      for s in active activating deactivating inactive failed reloading; do
        printf 'dgemma_replica_unit_state{replica="%s",unit="%s",state="%s"} %d\n' "$index" "$unit" "$s" \
          "$([ "$state" = "$s" ] && echo 1 || echo 0)"
      done
    done
    echo "# HELP dgemma_replica_unit_restarts_total How often systemd restarted each replica's unit on failure since it was started (NRestarts)."
    echo "# TYPE dgemma_replica_unit_restarts_total counter"
    for entry in $entries; do
      index=${entry%%:*}; rest=${entry#*:}; unit=${rest%%:*}
      printf 'dgemma_replica_unit_restarts_total{replica="%s",unit="%s"} %s\n' "$index" "$unit" \
        "$(systemctl show -p NRestarts --value "$unit" 2>/dev/null || echo 0)"
    done
    echo "# HELP dgemma_replica_out_of_service Whether the front door holds a replica out of service on purpose (1: drained or in maintenance)."
    echo "# TYPE dgemma_replica_out_of_service gauge"
    for entry in $entries; do
      index=${entry%%:*}; server=${entry##*:}
      printf '%s\n' "$servers" | awk -v s="$server" -v i="$index" \
        '$1 == s { printf "dgemma_replica_out_of_service{replica=\"%s\"} %d\n", i, ($2 + 0 != 0) ? 1 : 0 }'
    done
  } > "$dir/.replicas.prom.$$" && mv -f "$dir/.replicas.prom.$$" "$dir/replicas.prom"
}

while :; do
  [ "${DGEMMA_GPUS:-1}" = 0 ] || gpus
  weights_disk
  replicas
  [ "${DGEMMA_ONCE:-}" = 1 ] && exit 0
  sleep "$interval"
done
