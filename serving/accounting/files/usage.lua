-- Managed by dgemma-fleet (roles/gateway): each request's accounting at the gateway.
--
-- The filter `usage` reads what vLLM's answer says it used (`usage`: prompt_tokens and
-- completion_tokens, or the Responses API's input_tokens and output_tokens) as the answer
-- passes, a streamed one chunk by chunk (vLLM sends usage in its chunks when told to), and
-- the time to its first byte; it sets them as the request's variables for its record (the
-- log line), so that an answer cut off mid-stream still counts what was received. The replicas put
-- usage in every chunk of every stream for that count (--enable-force-include-usage); the filter
-- gives each client the stream it asked for (stream_options), as vLLM would have sent it. The
-- usage service adds each answer's tokens to the table `tokens_day` from the record (one counting
-- place, whose counts it keeps through a restart); until that lands, the action `budget`
-- counts them here, so that the request after the one that spent a budget is refused.

local now_ms = function()
  local t = core.now()
  return t.sec * 1000 + t.usec // 1000
end

-- Variables of the process that each thread writes its own of (lua-load-per-thread: each thread
-- has its own Lua state, and HAProxy 2.6's shared one broke this filter under load, "attempt to
-- index a thread value", then a crash; a process variable is seen by every thread): for a name,
-- one per thread, proc.PREFIX_NAME_THREAD. Only its thread writes one, so no addition is lost;
-- every thread reads them all
local threads = nil
local function per_thread(cache, prefix, name)
  local names = cache[name]
  if names == nil then
    threads = threads or tonumber(core.get_info().Nbthread) or 1
    -- a variable's name takes letters, digits, "." and "_": any other byte is written as _XX
    local safe = name:gsub("[^%w]", function(c) return string.format("_%02x", c:byte()) end)
    names = {}
    for thread = 1, threads do
      names[thread] = "proc." .. prefix .. "_" .. safe .. "_" .. thread
    end
    cache[name] = names
  end
  return names
end

-- What each thread has charged a subject today, as the count it expects the table to reach once the
-- usage service has added its answers: in proc.charged_SUBJECT:DAY_THREAD, read by every thread.
-- The usage service adds an answer's tokens to the table a few ms after its end, when its reservation
-- is given back; until then a next request, on any thread, counts them from here (a client that sends
-- its next request at once on a new connection, on another thread, spent a budget by a whole answer
-- more before). ``charged_names``: subject:day -> those variables' names, for `charged_day`
local charged_names = {}
local charged_day = nil

-- the names of `day`'s charges; as the day changes, this thread's variables of the day before are
-- dropped (a variable of the process lives as long as the process; one never set is nothing to drop)
local function charged_names_of(txn, day)
  if charged_day ~= day then
    for _, names in pairs(charged_names) do
      txn:unset_var(names[core.thread])
    end
    charged_names, charged_day = {}, day
  end
  return charged_names
end

-- An answer's tokens, charged by its thread: the count it expects the table to reach, from the table's
-- count now (not from what was counted against the request: that holds the other threads' charges,
-- which would then be counted twice) or from what it expects already when more
local function charge(txn, day_key, day, tokens)
  local own = per_thread(charged_names_of(txn, day), "charged", day_key)[core.thread]
  local entry = core.backends.tokens_day.stktable:lookup(day_key)
  local expected = math.max(tonumber(txn:get_var(own)) or 0, entry and tonumber(entry.gpc0) or 0) + tokens
  txn:set_var(own, expected)
end

-- What a subject spent today: the table's count, and what any thread charged it beyond that (the
-- answers the usage service has not added yet). A thread whose charges the table holds forgets them
local function spent_today(txn, day_key, table_count)
  local used = table_count
  for thread, name in ipairs(per_thread(charged_names, "charged", day_key)) do
    local expected = tonumber(txn:get_var(name))
    if expected then
      if expected > table_count then
        used = used + (expected - table_count)
      elseif thread == core.thread then
        txn:unset_var(name)
      end
    end
  end
  return used
end

-- What a request may spend, read from its body as vLLM reads it. vLLM takes the JSON object's top
-- level with Python's json (a key given twice: the last; a key may be written with escapes) and
-- pydantic's lax integers (1e3, 1000.0, "1000"): the reader below walks the top level, decodes
-- each key, and keeps the highest value among a key's repeats (never less than vLLM takes)
local SPENDS = {max_tokens = true, max_completion_tokens = true, max_output_tokens = true, n = true,
                best_of = true, prompt = true}

local function skip_space(body, at)
  return body:find("[^ \t\r\n]", at)
end

-- the end of the string opening at `at` (the position after its closing quote), or nil if cut off
local function string_end(body, at)
  local from = at + 1
  while true do
    local stop = body:find('["\\]', from)
    if stop == nil then
      return nil
    end
    if body:byte(stop) == 34 then -- '"'
      return stop + 1
    end
    from = stop + 2 -- an escape: its next character is not the end
  end
end

-- a key's text with its escapes read (\uXXXX of ASCII as that character, any other as "?")
local ESCAPES = {b = "\b", f = "\f", n = "\n", r = "\r", t = "\t"}
local function decoded(raw)
  if not raw:find("\\", 1, true) then
    return raw
  end
  local out, from = {}, 1
  while true do
    local at = raw:find("\\", from, true)
    if at == nil then
      out[#out + 1] = raw:sub(from)
      return table.concat(out)
    end
    out[#out + 1] = raw:sub(from, at - 1)
    local c = raw:sub(at + 1, at + 1)
    if c == "u" then
      local code = tonumber(raw:sub(at + 2, at + 5), 16)
      out[#out + 1] = (code and code < 128) and string.char(code) or "?"
      from = at + 6
    else
      out[#out + 1] = ESCAPES[c] or c
      from = at + 2
    end
  end
end

-- the end of the value at `at` (the position after it), or nil if the body ends first
local function value_end(body, at)
  local c = body:byte(at)
  if c == 34 then
    return string_end(body, at)
  end
  if c ~= 123 and c ~= 91 then -- a number, true, false or null: up to the next delimiter
    local stop = body:find("[,}%] \t\r\n]", at)
    return stop
  end
  local depth, from = 0, at
  while true do
    local stop = body:find('[%[%]{}"]', from)
    if stop == nil then
      return nil
    end
    local b = body:byte(stop)
    if b == 34 then
      from = string_end(body, stop)
      if from == nil then
        return nil
      end
    else
      depth = depth + ((b == 123 or b == 91) and 1 or -1)
      from = stop + 1
      if depth == 0 then
        return from
      end
    end
  end
end

-- how many prompts a completion's `prompt` holds: a string or a list of token ids is one, a list
-- of strings or of token lists one each
local function prompts(raw)
  if raw:byte(1) ~= 91 then
    return 1
  end
  local count, at = 0, skip_space(raw, 2)
  while at and raw:byte(at) ~= 93 do
    local b = raw:byte(at)
    if count == 0 and b ~= 34 and b ~= 91 then
      return 1 -- token ids
    end
    count = count + 1
    local stop = value_end(raw, at)
    at = stop and skip_space(raw, stop)
    if at and raw:byte(at) == 44 then
      at = skip_space(raw, at + 1)
    end
  end
  return math.max(count, 1)
end

-- a value as pydantic's lax integer takes it: a JSON number, or a string holding one; true is 1.
-- nil for null, false when it is none of these (vLLM refuses such a request: so does this)
local function number_of(raw)
  if raw == "null" then
    return nil
  end
  if raw == "true" then
    return 1
  end
  local text = raw:match('^"%s*(.-)%s*"$') or raw
  local n = tonumber(text)
  if n == nil or n ~= n or n == math.huge or n == -math.huge then
    return false
  end
  return math.max(math.floor(n), 0)
end

-- the top level of a JSON object: the values of the keys in SPENDS (each repeat kept), and whether
-- the object was read to its end; nil when the body is not an object
local function top_level(body)
  local at = skip_space(body, 1)
  if at == nil or body:byte(at) ~= 123 then
    return nil, false
  end
  local fields = {}
  at = at + 1
  while true do
    at = skip_space(body, at)
    if at == nil then
      return fields, false
    end
    local b = body:byte(at)
    if b == 125 then
      return fields, true
    elseif b == 44 then
      at = at + 1
    elseif b ~= 34 then
      return fields, false
    else
      local after = string_end(body, at)
      if after == nil then
        return fields, false
      end
      local name = decoded(body:sub(at + 1, after - 2))
      at = skip_space(body, after)
      if at == nil or body:byte(at) ~= 58 then
        return fields, false
      end
      at = skip_space(body, at + 1)
      if at == nil then
        return fields, false
      end
      local stop = value_end(body, at)
      if stop == nil then
        return fields, false
      end
      if SPENDS[name] then
        fields[name] = fields[name] or {}
        table.insert(fields[name], body:sub(at, stop - 1))
      end
      at = stop
    end
  end
end

-- the highest value among the keys `names` (each repeat counted) and the key that holds it; nil when
-- none is given (or null), false and the key when one is not a number
local function highest(fields, names)
  local top, which = nil, nil
  for _, name in ipairs(names) do
    for _, raw in ipairs(fields[name] or {}) do
      local n = number_of(raw)
      if n == false then
        return false, name
      end
      if n and (top == nil or n > top) then
        top, which = n, name
      end
    end
  end
  return top, which
end

local MAX_TOKENS = {"max_tokens", "max_completion_tokens", "max_output_tokens"}
local CHOICES = {"n", "best_of"}

-- What a generating request may spend: its max_tokens (the highest of max_tokens,
-- max_completion_tokens and the Responses API's max_output_tokens; `default` when it sets none:
-- the model's context) times its choices (the higher of n and best_of) times its prompts. Returns
-- the tokens and how they were read ("max_tokens 1000 x n 4"), or nil and why the body could not be read
local function asks(body, default)
  local fields, whole = top_level(body)
  if fields == nil then
    return nil, "its body is not a JSON object"
  end
  if not whole then
    return nil, "the gateway could not read its body whole (longer than it reads, or cut off)"
  end
  local out, which = highest(fields, MAX_TOKENS)
  if out == false then
    return nil, which .. " is not a number"
  end
  local said = out and (which .. " " .. out) or ("no max_tokens: the model's context, " .. default)
  out = out or default
  local choices, by = highest(fields, CHOICES)
  if choices == false then
    return nil, by .. " is not a number"
  end
  if choices and choices > 1 then
    said = said .. " x " .. by .. " " .. choices
  else
    choices = 1
  end
  local count = 1
  for _, raw in ipairs(fields.prompt or {}) do
    count = math.max(count, prompts(raw))
  end
  if count > 1 then
    said = said .. " x " .. count .. " prompts"
  end
  return out * choices * count, said
end

-- The tokens reserved by a subject's requests in flight, across this gateway's threads: counters of
-- its entry in the table requests_at_once (tracked as sc2), which Lua can only add 1 to
-- (sc_inc_gpc), at once across threads. An amount is added digit by digit in base 16: counter k
-- (0..7) counts the reserved amounts' units of 16^k, counter 8 + k what was given back of them; what
-- is in flight is the sum of (reserved - given back) x 16^k. Eight digits hold any budget's amount
-- (16^8 > 4e9, the schema's most), so a reservation costs at most 15 additions a digit, 120 in all
-- (six digits left 10^9 tokens' top digit about 950 additions)
local DIGITS, BASE = 8, 16
-- a counter is an unsigned 32-bit integer that wraps round (stick_table.c: std_t_uint++), and a busy
-- key's entry never expires: reserved and given back are compared modulo 2^32, so a count that has
-- wrapped round before the other still gives what is in flight (never 0, never 4 billion)
local WRAP = 1 << 32

local function add(txn, tokens, first)
  for k = 0, DIGITS - 1 do
    local digit = tokens
    if k < DIGITS - 1 then
      digit, tokens = tokens % BASE, tokens // BASE
    end
    for _ = 1, digit do
      txn.f:sc_inc_gpc(first + k, 2)
    end
  end
end

local function in_flight(txn)
  local total, unit = 0, 1
  for k = 0, DIGITS - 1 do
    -- given back first, then reserved: a reservation read in one but not the other counts as held
    local back = tonumber(txn.f:sc_get_gpc(DIGITS + k, 2)) or 0
    local held = ((tonumber(txn.f:sc_get_gpc(k, 2)) or 0) - back) % WRAP
    total = total + held * unit
    unit = unit * BASE
  end
  return total
end

-- The tokens a front end's requests in flight hold over all its users, across this process's
-- threads. A request tracks three sticky counters (tune.stick-counters' default), and a front end's request already
-- tracks three (its user's minute, its own minute, its user's requests in flight): no table entry
-- can be tracked for this one. So each thread keeps its share in a process variable of its own
-- (proc.whole_held_KEY_THREAD: only that thread writes it, so no addition is lost) and a reservation
-- sums them over the threads (added first, then summed, as above: of two at once, the later to sum
-- sees both). A stream stays on its thread: it gives back on the thread that reserved
local held_here = {} -- key -> what this thread's requests in flight hold
local whole_names = {} -- key -> its variables' names, one per thread
local function whole_slots(key)
  return per_thread(whole_names, "whole_held", key)
end

local function whole_in_flight(txn, key)
  local total = 0
  for _, name in ipairs(whole_slots(key)) do
    total = total + (tonumber(txn:get_var(name)) or 0)
  end
  return total
end

local function hold_whole(txn, key, tokens)
  local now = (held_here[key] or 0) + tokens
  held_here[key] = now
  txn:set_var(whole_slots(key)[core.thread], now)
end

local function give_back(txn)
  local tokens = tonumber(txn:get_var("txn.tok_reserved"))
  if tokens and tokens > 0 then
    txn:set_var("txn.tok_reserved", 0)
    add(txn, tokens, DIGITS)
  end
  local whole = tonumber(txn:get_var("txn.all_tok_reserved"))
  if whole and whole > 0 then
    txn:set_var("txn.all_tok_reserved", 0)
    hold_whole(txn, txn:get_var("txn.key"), -whole)
  end
end

-- Two budgets are counted alike: a key's (a front end's user's), held in the table, and a front end's
-- over all its users, held in the threads' variables. Each its request variables' names, and how what
-- its requests in flight hold is added to and read
local KEY_BUDGET = {limit = "txn.tok_limit", used = "txn.tok_used", left = "txn.tok_left", spent = "txn.tok_spent",
                    short = "txn.tok_short", day_key = "txn.day_key", reserved = "txn.tok_reserved",
                    hold = function(txn, tokens) add(txn, tokens, 0) end,
                    held = in_flight}
local WHOLE_BUDGET = {limit = "txn.all_tok_limit", used = "txn.all_tok_used", left = "txn.all_tok_left",
                      spent = "txn.all_tok_spent", short = "txn.all_tok_short", day_key = "txn.all_day_key",
                      reserved = "txn.all_tok_reserved",
                      hold = function(txn, tokens) hold_whole(txn, txn:get_var("txn.key"), tokens) end,
                      held = function(txn) return whole_in_flight(txn, txn:get_var("txn.key")) end}

-- Whether the budget has tokens left today: what the table says was spent, and what the threads
-- charged beyond it (spent_today), against its limit. Sets its used and left; its spent when nothing
-- is left. A budget of no limit has tokens left
local function has_left(txn, budget)
  local limit = tonumber(txn:get_var(budget.limit)) or 0
  if limit <= 0 then
    return true
  end
  local used = spent_today(txn, txn:get_var(budget.day_key), tonumber(txn:get_var(budget.used)) or 0)
  txn:set_var(budget.used, used)
  txn:set_var(budget.left, math.max(limit - used, 0))
  if used >= limit then
    txn:set_var(budget.spent, 1)
    return false
  end
  return true
end

-- What the request may spend, added to what the budget's requests in flight hold, then the whole
-- checked against what is left (added first, then checked: of two requests at once on two threads, the
-- later to read sees both, so two that do not both fit are never both let through). Over: everything
-- this request holds given back at once, and the budget's short set. A budget of no limit lets it through
local function reserved_in(txn, budget, need)
  local limit = tonumber(txn:get_var(budget.limit)) or 0
  if limit <= 0 then
    return true
  end
  local used = tonumber(txn:get_var(budget.used)) or 0
  local held
  -- not used + need: a need read as math.maxinteger (max_tokens 1e30) would wrap around below the limit
  if need <= limit - used then
    budget.hold(txn, need)
    txn:set_var(budget.reserved, need)
    held = budget.held(txn)
    if used + held <= limit then
      txn:set_var(budget.left, limit - used - held)
      return true
    end
    held = held - need
  else
    held = budget.held(txn)
  end
  give_back(txn)
  txn:set_var(budget.left, math.max(limit - used - held, 0))
  txn:set_var(budget.short, 1)
  return false
end

-- The budget, reserve then settle, once every other limit has let the request through (one call into
-- Lua a request: each costs a gateway under load a coroutine and the objects it is handed). What the
-- key (a front end's user) spent today against its limit, and a front end's over all its users against
-- theirs (has_left: each budget's used and left, its spent when nothing is left); then what this request
-- may spend, read from its body (txn.tok_default, the model's context, is set for a request that
-- generates alone: any other has nothing to reserve): txn.tok_unread when its body cannot be read,
-- else txn.tok_need (and txn.tok_asks, how it was read), reserved in the key's budget, then in a front
-- end's over all its users (reserved_in: txn.tok_short or txn.all_tok_short when it does not fit). Let
-- through: held until its answer is charged (Usage:charge gives it back; the usage service has the
-- answer's usage in the table a few ms later)
core.register_action("budget", {"http-req"}, function(txn)
  charged_names_of(txn, txn:get_var("txn.day"))
  if not has_left(txn, KEY_BUDGET) or not has_left(txn, WHOLE_BUDGET) then
    return
  end
  local default = tonumber(txn:get_var("txn.tok_default"))
  if default == nil then
    return
  end
  local body = txn.f:req_body() or ""
  local need, said = asks(body, default)
  if need == nil then
    txn:set_var("txn.tok_unread", said)
    return
  end
  need = math.tointeger(need) or math.maxinteger
  txn:set_var("txn.tok_need", need)
  txn:set_var("txn.tok_asks", string.format("%.0f tokens (%s)", need, said))
  -- the most its prompt can be: a token is at least a byte of the text, which JSON only lengthens
  txn:set_var("txn.tok_body", #body)
  if reserved_in(txn, KEY_BUDGET, need) then
    reserved_in(txn, WHOLE_BUDGET, need)
  end
end)

-- The day's tokens are known here once the usage service has put them in this process's table and
-- marked it (`@counts:PID`, this worker's pid): a new process (a reload, a restart) answers at once,
-- while its tables come from the old process, the other gateway and the usage service, in no set
-- order. Until the mark, a request that would be counted is asked to come back in a second (503,
-- Retry-After: 1) rather than counted from zero; a process that gets no mark within
-- SYNC_GIVE_UP_S (no usage service) counts from here. Asked until it answers 1, which it says in
-- proc.counts_known for the gateway's rules to read first. A fetch, not an action that waits: a Lua
-- action that yields beside the filter below broke the filter now and then in HAProxy 2.6
-- ("attempt to index a thread value").
local SYNC_GIVE_UP_S = 10
local started = nil -- the first request's time (at load time, HAProxy's clock is not running yet)
local mark = nil
local synced = false

core.register_fetches("counts_known", function(txn)
  if synced then
    return 1
  end
  mark = mark or ("@counts:" .. tostring(core.get_info().Pid))
  started = started or core.now().sec
  if core.backends.tokens_day.stktable:lookup(mark) then
    synced = true
  elseif core.now().sec - started >= SYNC_GIVE_UP_S then
    core.Warning("dgemma usage: the usage service did not mark the day's tokens within " .. SYNC_GIVE_UP_S ..
                 " s: counting from here")
    synced = true
  end
  if synced then
    -- every thread of this process reads it before calling here (gateway.cfg.j2): one call into Lua
    -- a request fewer from now on (this process's variables start empty: a new process asks again)
    txn:set_var("proc.counts_known", true)
  end
  return synced and 1 or 0
end)

local function last_number(text, names)
  local found = nil
  for _, name in ipairs(names) do
    for n in text:gmatch('"' .. name .. '"%s*:%s*(%d+)') do
      found = n
    end
    if found then
      return found
    end
  end
  return nil
end

local PROMPT = {"prompt_tokens", "input_tokens"}
local COMPLETION = {"completion_tokens", "output_tokens"}
local TAIL = 512 -- a usage object cut between two chunks is found whole in the tail plus the next

local Usage = {}
Usage.id = "dgemma usage"
Usage.flags = filter.FLT_CFG_FL_HTX
Usage.__index = Usage

function Usage:new()
  return setmetatable({tail = "", first = false, charged = false, shape = nil, choices = {},
                       final = false}, Usage)
end

-- what the client asked of a stream's usage (its request's stream_options, read by the gateway's
-- rules): "every" (usage in each chunk too: the stream is left as it is), "final" (vLLM's last chunk
-- of its own, `"choices": []`, and no usage in the others), "none" (no usage at all, as vLLM streams
-- to a client that did not ask: the SDK's loop over chunk.choices[0] must not meet an empty list)
local function asked(txn)
  local function yes(name)
    local value = txn:get_var(name)
    return value == true or value == 1 or value == "1" or value == "true"
  end
  if not yes("txn.usage_asked") then
    return "none"
  end
  return yes("txn.usage_every") and "every" or "final"
end

function Usage:http_headers(txn, http_msg)
  if http_msg.channel:is_resp() then
    local kind = http_msg:get_headers()["content-type"]
    self.stream = kind ~= nil and kind[0] ~= nil and kind[0]:find("text/event-stream", 1, true) ~= nil
    -- the Chat Completions and Completions streams alone: the Responses API carries its usage in its
    -- own last event (response.completed) whatever the client asked
    local path = txn:get_var("txn.path") or ""
    self.responses = self.stream and path:sub(-13) == "/v1/responses"
    if self.stream and path:sub(-12) == "/completions" then
      local shape = asked(txn)
      self.shape = shape ~= "every" and shape or nil
    end
    filter.register_data_filter(self, http_msg.channel)
  end
end

-- the first event of a stream that carries generated text (or a tool call): vLLM's first chunk
-- names the role alone, before anything is generated
local FIRST = {'"content"%s*:%s*"[^"]', '"text"%s*:%s*"[^"]', '"delta"%s*:%s*"[^"]', '"tool_calls"%s*:%s*%['}

local function generated(text)
  for _, pattern in ipairs(FIRST) do
    if text:find(pattern) then
      return true
    end
  end
  return false
end

-- an event with its usage taken out. A JSON string holds no unescaped quote, so `"usage":` is never
-- found inside generated text, and a usage object holds no string, so %b{} is the whole of it
local function without_usage(event)
  local out, n = event:gsub(',%s*"usage"%s*:%s*%b{}', "", 1)
  if n == 0 then
    out, n = event:gsub(',%s*"usage"%s*:%s*null', "", 1)
  end
  if n == 0 then
    out = event:gsub('"usage"%s*:%s*%b{}%s*,%s*', "", 1)
  end
  return out
end

local USAGE_ONLY = '"choices"%s*:%s*%[%s*%]'

-- whole events ("data: {...}" and the blank line after it) in the shape the client asked for
local function reshaped(events, shape)
  local out = {}
  for event, gap in events:gmatch("(.-)(\r?\n\r?\n)") do
    if event:find('"usage"', 1, true) == nil then
      out[#out + 1] = event .. gap
    elseif event:find(USAGE_ONLY) then
      if shape == "final" then
        out[#out + 1] = event .. gap
      end -- "none": vLLM sends no such chunk to a client that did not ask
    else
      out[#out + 1] = without_usage(event) .. gap
    end
  end
  return table.concat(out)
end

-- where the last whole event in text ends (the end of its blank line), or nil
local function last_event_end(text)
  local last, from = nil, 1
  while true do
    local _, stop = text:find("\n\r?\n", from)
    if stop == nil then
      return last
    end
    last, from = stop, stop + 1
  end
end

-- A stream's count. vLLM puts in each chunk the count of that chunk's choice alone (serving_chat.py and
-- serving_completion.py: previous_num_tokens[i]), and the whole answer's in its own last chunk: with
-- n > 1 (or several prompts) the last chunk's count before a cut is one choice's. So each choice's
-- highest count is kept, by its index, and a stream cut before its last chunk is charged their sum;
-- the last chunk, when it comes, is the count. An event is one line "data: {...}" and a blank line
-- (JSON holds no raw line break), read whole or not at all; one seen twice (the tail) changes nothing.
local CHOICE_INDEX = '"choices"%s*:%s*%[%s*{%s*"index"%s*:%s*(%d+)'

function Usage:read_events(text)
  for event in text:gmatch("data:%s?([^\r\n]*)\r?\n\r?\n") do
    local completion = last_number(event, COMPLETION)
    if completion and event:find(USAGE_ONLY) then
      self.final = true
    elseif completion and not self.final then
      local index = event:match(CHOICE_INDEX)
      if index then
        self.choices[index] = math.max(self.choices[index] or 0, tonumber(completion))
      end
    end
  end
  if self.final or next(self.choices) == nil then
    return nil
  end
  local sum = 0
  for _, count in pairs(self.choices) do
    sum = sum + count
  end
  return sum
end

function Usage:read(txn, text)
  -- time to the first token: a stream's first generated text (a whole answer's is its duration)
  if self.stream and not self.first and generated(text) then
    self.first = true
    txn:set_var("txn.ttft_ms", now_ms() - (tonumber(txn:get_var("txn.t0_ms")) or now_ms()))
  end
  local prompt = last_number(text, PROMPT)
  -- a stream's choices so far, summed, until its last chunk says the whole; else the answer's own
  local completion = self.stream and self:read_events(text) or last_number(text, COMPLETION)
  if self.final then
    completion = last_number(text, COMPLETION) or completion
  end
  if prompt then
    txn:set_var("txn.prompt_tokens", tonumber(prompt))
  end
  if completion then
    txn:set_var("txn.completion_tokens", tonumber(completion))
  end
end

function Usage:http_payload(txn, http_msg)
  local data = http_msg:body()
  if self.shape == nil then
    -- nothing to change: read as it passes (nothing returned: HAProxy forwards it all)
    if data ~= nil and #data > 0 then
      local text = self.tail .. data
      self:read(txn, text)
      self.tail = #text > TAIL and text:sub(-TAIL) or text
    end
    return
  end
  -- whole events alone are read, reshaped and forwarded; the rest stays in the buffer until its end
  -- comes (a number returned: what is not forwarded here is kept), unless the buffer is full or the
  -- answer ends without one. No data (the answer's end): nothing returned, nothing held
  if data == nil or #data == 0 then
    return
  end
  local stop = last_event_end(data)
  if stop == nil then
    if http_msg:is_full() or http_msg:eom() or not http_msg:may_recv() then
      self:read(txn, data)
      http_msg:forward(#data)
    end
    return 0
  end
  local events = data:sub(1, stop)
  self:read(txn, events)
  local shaped = reshaped(events, self.shape)
  -- HAProxy 2.6's set() in place left the old bytes to be handed again: the events are taken out,
  -- and what the client gets is sent in their place (shorter: there is room)
  if shaped ~= events then
    http_msg:remove(0, stop)
    http_msg:send(shaped)
  else
    http_msg:forward(stop)
  end
  return 0
end

-- charged when the answer's analysis ends (whole, cut off, or its client gone), and its reservation
-- given back in the same step: until then the reservation (at least what the answer spends, its prompt
-- aside) stands for it, so a next request never finds it uncounted. One callback a channel fewer than
-- charging at http_end too: each call into Lua costs a gateway under load
function Usage:charge(txn)
  if self.charged then
    return
  end
  self.charged = true
  -- a stream that says nothing of what it cost is charged the most it could have spent: what it
  -- reserved, and its request's body in bytes for its prompt. A Responses stream cut before its last
  -- event (response.completed, the only one that vLLM gives its usage: cutting a stream short is no
  -- way around a budget, for the prompt either), and an external API's stream whose client asked no
  -- usage (it streams usage only to a request that asks: and it costs money)
  if txn:get_var("txn.completion_tokens") == nil and
     (self.responses or (self.stream and txn:get_var("txn.pool") == "upstream")) then
    local held = tonumber(txn:get_var("txn.tok_reserved"))
    if not held or held == 0 then
      held = tonumber(txn:get_var("txn.all_tok_reserved"))
    end
    if held and held > 0 then
      txn:set_var("txn.completion_tokens", held)
      if txn:get_var("txn.prompt_tokens") == nil then
        txn:set_var("txn.prompt_tokens", tonumber(txn:get_var("txn.tok_body")) or 0)
      end
    end
  end
  give_back(txn)
  local tokens = (tonumber(txn:get_var("txn.prompt_tokens")) or 0) +
                 (tonumber(txn:get_var("txn.completion_tokens")) or 0)
  if tokens > 0 then
    local day = txn:get_var("txn.day")
    local day_key, whole_key = txn:get_var("txn.day_key"), txn:get_var("txn.all_day_key")
    if day_key then
      charge(txn, day_key, day, tokens)
    end
    if whole_key then
      charge(txn, whole_key, day, tokens)
    end
  end
end

function Usage:end_analyze(txn, chn)
  if chn:is_resp() then
    self:charge(txn)
  end
end

core.register_filter("usage", Usage, function(usage, args)
  return usage
end)
