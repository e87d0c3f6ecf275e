-- Managed by dgemma-fleet (roles/gateway): each request's accounting at the gateway, where
-- HAProxy's own rules cannot do it (serving/accounting/templates/gateway.cfg.j2 does the rest).
--
-- The action `asks` reads what a request may spend from its body, as vLLM reads it; the gateway's
-- rules reserve it in their counters (docs/accounting.md). The filter `usage` reads what vLLM's
-- answer says it used (`usage`: prompt_tokens and completion_tokens, or the Responses API's
-- input_tokens and output_tokens) as the answer passes, a streamed one chunk by chunk (vLLM sends
-- usage in its chunks when told to), and the time to its first token; it sets them as the request's
-- variables for its record (the log line), so that an answer cut off mid-stream still counts what
-- was received. The replicas put usage in every chunk of every stream for that count
-- (--enable-force-include-usage); the filter gives each client the stream it asked for
-- (stream_options), as vLLM would have sent it. The usage service counts each answer's tokens from
-- the record and gives back what the request held.

local now_ms = function()
  local t = core.now()
  return t.sec * 1000 + t.usec // 1000
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

-- What a generating request may spend (the rules call this for a key with a token budget alone):
-- txn.tok_need and txn.tok_asks (how it was read, for a refusal's message), or txn.tok_unread, why
-- its body cannot be read. txn.tok_default: the model's context, for a request that sets no max_tokens
core.register_action("asks", {"http-req"}, function(txn)
  local default = tonumber(txn:get_var("txn.tok_default"))
  if default == nil then
    return
  end
  local need, said = asks(txn.f:req_body() or "", default)
  if need == nil then
    txn:set_var("txn.tok_unread", said)
    return
  end
  need = math.tointeger(need) or math.maxinteger
  txn:set_var("txn.tok_need", need)
  txn:set_var("txn.tok_asks", string.format("%.0f tokens (%s)", need, said))
end)

-- A request that fits beside what was spent but not beside what its subject's requests hold waits a
-- moment before it is refused for now: what an answer held is given back a few ms after it ends, as
-- the usage service counts it, and a client that sends its next request the moment an answer ends
-- would be refused only for that (HAProxy's rules cannot wait). What is held is read again from
-- the budget's tracked counters (the argument: 0 the key's, sc0; 1 a front end's whole, sc1)
-- every SETTLE_STEP_MS for up to SETTLE_MS, with what was spent; the budget's used, held and left
-- set to what was read last
local SETTLE_MS, SETTLE_STEP_MS = 200, 10
local WRAP = 1 << 32

-- each budget's variables, by its tracked counter
local BUDGETS = {
  [0] = {limit = "txn.tok_limit", used = "txn.tok_used", held = "txn.tok_held", left = "txn.tok_left",
         day_key = "txn.day_key"},
  [1] = {limit = "txn.all_tok_limit", used = "txn.all_tok_used", held = "txn.all_tok_held", left = "txn.all_tok_left",
         day_key = "txn.all_day_key"},
}

core.register_action("settling", {"http-req"}, function(txn, sc)
  local counter = tonumber(sc)
  local budget = BUDGETS[counter]
  local day_key = txn:get_var(budget.day_key)
  local limit = tonumber(txn:get_var(budget.limit)) or 0
  local held, used, waited = 0, 0, 0
  while true do
    -- what was given back first, then what was held (one read in one but not the other counts as
    -- held), then what was spent: the usage service tells an answer's tokens before it gives back
    -- what the request held, so an answer read as given back is read as spent
    local back = (tonumber(txn.f:sc_get_gpc(2, counter)) or 0) + (tonumber(txn.f:sc_get_gpc(0, counter)) or 0)
    held = ((tonumber(txn.f:sc_get_gpc(1, counter)) or 0) - back) % WRAP
    local entry = core.backends.tokens_day.stktable:lookup(day_key)
    used = entry and tonumber(entry.gpc0) or 0
    if used + held <= limit or waited >= SETTLE_MS then
      break
    end
    core.msleep(SETTLE_STEP_MS)
    waited = waited + SETTLE_STEP_MS
  end
  txn:set_var(budget.used, used)
  txn:set_var(budget.held, held)
  txn:set_var(budget.left, limit - used - held)
end, 1)

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

-- A stream that says nothing of what it cost is charged the most it could have spent: what it
-- reserved, and its request's body in bytes for its prompt. A Responses stream cut before its last
-- event (response.completed, the only one that vLLM gives its usage: cutting a stream short is no
-- way around a budget, for the prompt either), and an external API's stream whose client asked no
-- usage (it streams usage only to a request that asks: and it costs money). Set as the answer's
-- analysis ends (whole, cut off, or its client gone), for its record
function Usage:charge(txn)
  if self.charged then
    return
  end
  self.charged = true
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
end

function Usage:end_analyze(txn, chn)
  if chn:is_resp() then
    self:charge(txn)
  end
end

core.register_filter("usage", Usage, function(usage, args)
  return usage
end)
