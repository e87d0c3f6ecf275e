-- A gateway's server that is answering live requests is not taken out of its pool by a health check
-- that timed out behind those requests (loaded by the gateway: serving/accounting/templates/gateway.cfg.j2).
--
-- A check is one more TLS handshake and request among the gateway's own traffic: on a busy gateway
-- (a burst of new TLS clients, a host that serves too, a gateway kept to two threads) it waits
-- behind that traffic and times out, and two in a row took a pool out of service while its servers
-- were answering every request sent to them (503 "no server available"). Here, four times a second,
-- while the gateway is busy (its threads idle under the share this file is loaded with, or were in
-- the last BUSY_HOLD_S: a check that timed out then may have waited behind its own traffic), a server
-- whose last check timed out is called up again, before a second timeout takes it out, when
--   * it answered live requests (2xx) since the last look, whatever the check's timeout; or
--   * its check timed out after its host took the connection (L6TOUT, L7TOUT: the host is there,
--     the handshake or the answer was late) and it holds live requests now: a burst's first
--     answers come after its checks have timed out. For KEEP_S at most without an answer: a front
--     door that takes connections and answers nothing goes out then.
-- What a check finds otherwise stands: a refused connection, a front door answering 503 (its vLLM
-- down) or 404 (its pool drained), a host that does not take the connection (L4TOUT: a dead host, a
-- cut link) and answers nothing, and any timeout on a gateway with time to spare (the server's own
-- slowness): its checks take it out as before.
local BUSY_IDLE_PCT = tonumber((...)) or 50  -- lua-load's argument (serving/haproxy/instance.py)
local BUSY_HOLD_S = 3
local TICK_MS = 250
local KEEP_S = 10
local AFTER_CONNECT = { L6TOUT = true, L7TOUT = true }
local TIMED_OUT = { L4TOUT = true, L6TOUT = true, L7TOUT = true }
local answered, quiet_since = {}, {}

local busy_until = 0

local function look()
    local now_s = core.now().sec
    if (tonumber(core.get_info().Idle_pct) or 100) < BUSY_IDLE_PCT then
        busy_until = now_s + BUSY_HOLD_S
    end
    local busy = now_s <= busy_until
    for name, backend in pairs(core.backends) do
        if name:sub(1, 5) == "pool_" then
            for server_name, server in pairs(backend.servers) do
                local stats = server:get_stats()
                local key = name .. "/" .. server_name
                local count = tonumber(stats.hrsp_2xx) or 0
                local before = answered[key]
                answered[key] = count
                local fresh = before ~= nil and count > before
                if fresh then
                    quiet_since[key] = nil
                end
                local status = stats.status or ""
                local check = (stats.check_status or ""):gsub("^%* ", "")
                local falling = status:match("^UP %d+/%d+$") or status:match("^DOWN")
                local holding = (tonumber(stats.scur) or 0) > 0
                local why
                if busy and falling and TIMED_OUT[check] then
                    if fresh then
                        why = string.format("answered %d requests", count - before)
                    elseif AFTER_CONNECT[check] and holding then
                        quiet_since[key] = quiet_since[key] or now_s
                        if now_s - quiet_since[key] < KEEP_S then
                            why = string.format("holds %s live requests", stats.scur)
                        end
                    end
                end
                if why then
                    server:check_force_up()
                    core.Warning(string.format("%s kept in service: its health check timed out (%s) while it %s",
                        key, check, why))
                end
            end
        end
    end
end

core.register_task(function()
    while true do
        local ok, err = pcall(look)
        if not ok then
            core.Alert("live_answers.lua: " .. tostring(err))
        end
        core.msleep(TICK_MS)
    end
end)
