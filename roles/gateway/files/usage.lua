-- Managed by dgemma-fleet (roles/gateway): each request's accounting at the gateway.
--
-- The filter `usage` reads what vLLM's answer says it used (`usage`: prompt_tokens and
-- completion_tokens, or the Responses API's input_tokens and output_tokens) as the answer
-- passes, a streamed one chunk by chunk (vLLM sends usage in its chunks when told to), and
-- the time to its first byte; it sets them as the request's variables for its record (the
-- log line), so that an answer cut off mid-stream still counts what was received. The replicas put
-- usage in every chunk of every stream for that count (--enable-force-include-usage); the filter
-- gives each client the stream it asked for (stream_options), as vLLM would have sent it. HAProxy 2.6
-- cannot add to a stick-table counter (no sc-add-gpc): the usage service adds each answer's
-- tokens to the table `tokens_day` from the record; until that lands, the action `budget`
-- counts them here, so that the request after the one that spent a budget is refused.

local now_ms = function()
  local t = core.now()
  return t.sec * 1000 + t.usec // 1000
end

-- tokens charged by this thread since the process started, per subject and day: subject:day ->
-- tokens (entries of earlier days are dropped as the day changes). Each thread has its own Lua
-- state (lua-load-per-thread: HAProxy 2.6's shared state broke this filter under load, "attempt
-- to index a thread value", then a crash); a connection stays on its thread, so a client's next
-- request on it sees what its last answer spent even before the usage service has told the table
local charged = {}
local charged_day = nil

-- ``seen``: what the subject had spent when the request came (the table's count, or this
-- process's): a process started mid-day (a reload) counts on from the table, not from 0
local function charge(day_key, day, seen, tokens)
  if charged_day ~= day then
    charged, charged_day = {}, day
  end
  charged[day_key] = math.max(charged[day_key] or 0, seen) + tokens
end

-- the budget: what the table says the subject spent today, or what was charged here when more
-- (the usage service has not added the latest answers yet); sets txn.tok_used and txn.tok_left
core.register_action("budget", {"http-req"}, function(txn)
  local day_key = txn:get_var("txn.day_key")
  local used = tonumber(txn:get_var("txn.tok_used")) or 0
  local here = charged_day == txn:get_var("txn.day") and charged[day_key] or 0
  if here > used then
    used = here
  end
  local limit = tonumber(txn:get_var("txn.tok_limit")) or 0
  txn:set_var("txn.tok_used", used)
  txn:set_var("txn.tok_left", math.max(limit - used, 0))
  if used >= limit then
    txn:set_var("txn.tok_spent", 1)
  end
end)

-- The day's tokens are known here once the usage service has put them in this process's table and
-- marked it (`@counts:PID`, this worker's pid): a new process (a reload, a restart) answers at once,
-- while its tables come from the old process, the other gateway and the usage service, in no set
-- order. Until the mark, a request that would be counted is asked to come back in a second (503,
-- Retry-After: 1) rather than counted from zero; a process that gets no mark within
-- SYNC_GIVE_UP_S (no usage service) counts from here. A fetch, not an action that waits: a Lua
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
  return setmetatable({tail = "", started = 0, first = false, charged = false, shape = nil, choices = {},
                       final = false}, Usage)
end

function Usage:start_analyze(txn, chn)
  if not chn:is_resp() then
    self.started = now_ms()
  end
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
    txn:set_var("txn.ttft_ms", now_ms() - self.started)
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

-- charged when the answer ends, before its last bytes leave (the client's next request then finds it
-- counted); at the end of the analysis for an answer cut off before its end
function Usage:charge(txn)
  if self.charged then
    return
  end
  self.charged = true
  local day_key = txn:get_var("txn.day_key")
  if day_key then
    local tokens = (tonumber(txn:get_var("txn.prompt_tokens")) or 0) +
                   (tonumber(txn:get_var("txn.completion_tokens")) or 0)
    if tokens > 0 then
      charge(day_key, txn:get_var("txn.day"), tonumber(txn:get_var("txn.tok_used")) or 0, tokens)
    end
  end
end

function Usage:http_end(txn, http_msg)
  if http_msg.channel:is_resp() then
    self:charge(txn)
  end
  return 1
end

function Usage:end_analyze(txn, chn)
  if chn:is_resp() then
    self:charge(txn)
  end
end

core.register_filter("usage", Usage, function(usage, args)
  return usage
end)
