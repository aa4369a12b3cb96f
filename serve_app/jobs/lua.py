"""The Lua scripts behind :class:`serve_app.jobs.store.JobStore`: every state change that
touches more than one key runs as one script, so Redis applies it atomically.

Conventions: ``KEYS`` are the keys a script is about; keys derived from a job's fields (the
idempotency mapping ``key:{k}``, the running list of a job's last worker) are built inside the
script from ``base`` (``"{prefix}:{namespace}:"``), so the store targets one Redis server or
a replicated primary, not Redis Cluster. Times are the caller's unix seconds (its injected
clock), TTLs are milliseconds. A *view* reply is ``[HGETALL of the job, LPOS in queued or -1]``
(:func:`serve_app.jobs.view.view_from_reply`); ``false`` (``None`` in Python) means no such job.
"""

from __future__ import annotations

_PRELUDE = """
local function view(job_key, queued_key, id)
  local fields = redis.call('HGETALL', job_key)
  if #fields == 0 then return false end
  return {fields, redis.call('LPOS', queued_key, id) or -1}
end
local function finalize(job_key, base, status, now, ttl_ms)
  redis.call('HSET', job_key, 'status', status, 'finished_at', now)
  redis.call('PEXPIRE', job_key, ttl_ms)
  local key = redis.call('HGET', job_key, 'idempotency_key')
  if key then redis.call('PEXPIRE', base .. 'key:' .. key, ttl_ms) end
end
"""

# KEYS: job, queued[, key:{idempotency_key}]
# ARGV: id, base, max_queued, body_hash, field, value, field, value, ...
# -> {'created', view} | {'existing', view} | {'mismatch'} | {'full', queued_count}
SUBMIT = _PRELUDE + """
if KEYS[3] then
  local known = redis.call('HMGET', KEYS[3], 'job_id', 'body_hash')
  if known[1] and redis.call('EXISTS', ARGV[2] .. 'job:' .. known[1]) == 1 then
    if known[2] ~= ARGV[4] then return {'mismatch'} end
    return {'existing', view(ARGV[2] .. 'job:' .. known[1], KEYS[2], known[1])}
  end
end
local queued = redis.call('LLEN', KEYS[2])
if queued >= tonumber(ARGV[3]) then return {'full', queued} end
redis.call('HSET', KEYS[1], unpack(ARGV, 5))
redis.call('RPUSH', KEYS[2], ARGV[1])
if KEYS[3] then
  redis.call('HSET', KEYS[3], 'job_id', ARGV[1], 'body_hash', ARGV[4])
  redis.call('PERSIST', KEYS[3])
end
return {'created', view(KEYS[1], KEYS[2], ARGV[1])}
"""

# KEYS: job, queued. ARGV: id. -> view | false
GET = _PRELUDE + """
return view(KEYS[1], KEYS[2], ARGV[1])
"""

# KEYS: queued. ARGV: base. -> view of the first queued job | false (dangling ids are dropped)
HEAD = _PRELUDE + """
while true do
  local id = redis.call('LINDEX', KEYS[1], 0)
  if not id then return false end
  local found = view(ARGV[1] .. 'job:' .. id, KEYS[1], id)
  if found then return found end
  redis.call('LPOP', KEYS[1])
end
"""

# KEYS: job, queued, running:{worker}, worker:{worker}, rate_since
# ARGV: id, worker, now, heartbeat_ttl_ms -> view | false (not queued any more)
CLAIM = _PRELUDE + """
if redis.call('LREM', KEYS[2], 0, ARGV[1]) == 0 then return false end
if redis.call('HGET', KEYS[1], 'status') ~= 'queued' then return false end
redis.call('HSET', KEYS[1], 'status', 'running', 'worker', ARGV[2], 'started_at', ARGV[3])
redis.call('HINCRBY', KEYS[1], 'attempts', 1)
redis.call('RPUSH', KEYS[3], ARGV[1])
redis.call('SET', KEYS[4], ARGV[3], 'PX', ARGV[4], 'NX')
redis.call('SET', KEYS[5], ARGV[3], 'NX')
return view(KEYS[1], KEYS[2], ARGV[1])
"""

# KEYS: job, queued. ARGV: id, base, now, ttl_ms -> view | false
CANCEL = _PRELUDE + """
local status = redis.call('HGET', KEYS[1], 'status')
if status == 'queued' then
  redis.call('LREM', KEYS[2], 0, ARGV[1])
  finalize(KEYS[1], ARGV[2], 'cancelled', ARGV[3], ARGV[4])
elseif status == 'running' then
  redis.call('HSET', KEYS[1], 'cancel_requested', '1')
end
return view(KEYS[1], KEYS[2], ARGV[1])
"""

# KEYS: job, queued, completions
# ARGV: id, base, now, ttl_ms, worker, status, payload_field, payload, status_code or '',
#       oldest completion time kept
# -> the final status recorded | false (unknown job, or already final)
FINISH = _PRELUDE + """
local status = redis.call('HGET', KEYS[1], 'status')
if status ~= 'queued' and status ~= 'running' then return false end
redis.call('LREM', KEYS[2], 0, ARGV[1])
local owner = redis.call('HGET', KEYS[1], 'worker')
if owner then redis.call('LREM', ARGV[2] .. 'running:' .. owner, 0, ARGV[1]) end
local final = ARGV[6]
if redis.call('HGET', KEYS[1], 'cancel_requested') == '1' then
  final = 'cancelled'
else
  redis.call('HSET', KEYS[1], ARGV[7], ARGV[8])
  if ARGV[9] ~= '' then redis.call('HSET', KEYS[1], 'status_code', ARGV[9]) end
end
redis.call('HSET', KEYS[1], 'worker', ARGV[5])
finalize(KEYS[1], ARGV[2], final, ARGV[3], ARGV[4])
redis.call('ZADD', KEYS[3], ARGV[3], ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', '(' .. ARGV[10])
return final
"""

# KEYS: job, queued, running:{worker}. ARGV: id, base, now, ttl_ms, worker
# -> 'queued' | 'cancelled' (a cancel was requested) | false (not running on that worker)
REQUEUE = _PRELUDE + """
if redis.call('HGET', KEYS[1], 'status') ~= 'running' then return false end
if redis.call('HGET', KEYS[1], 'worker') ~= ARGV[5] then return false end
redis.call('LREM', KEYS[3], 0, ARGV[1])
if redis.call('HGET', KEYS[1], 'cancel_requested') == '1' then
  finalize(KEYS[1], ARGV[2], 'cancelled', ARGV[3], ARGV[4])
  return 'cancelled'
end
redis.call('HSET', KEYS[1], 'status', 'queued')
redis.call('LREM', KEYS[2], 0, ARGV[1])
redis.call('LPUSH', KEYS[2], ARGV[1])
return 'queued'
"""

# KEYS: running:{worker}, worker:{worker}, queued. ARGV: base, now, ttl_ms, worker
# -> ids put back at the head of queued, last first (nothing while the heartbeat lives)
RECOVER = _PRELUDE + """
if redis.call('EXISTS', KEYS[2]) == 1 then return {} end
local ids = redis.call('LRANGE', KEYS[1], 0, -1)
local moved = {}
for i = #ids, 1, -1 do
  local job_key = ARGV[1] .. 'job:' .. ids[i]
  local fields = redis.call('HMGET', job_key, 'status', 'worker', 'cancel_requested')
  if fields[1] == 'running' and fields[2] == ARGV[4] then
    if fields[3] == '1' then
      finalize(job_key, ARGV[1], 'cancelled', ARGV[2], ARGV[3])
    else
      redis.call('HSET', job_key, 'status', 'queued')
      redis.call('LREM', KEYS[3], 0, ids[i])
      redis.call('LPUSH', KEYS[3], ids[i])
      table.insert(moved, ids[i])
    end
  end
end
redis.call('DEL', KEYS[1])
return moved
"""

# KEYS: job. ARGV: request -> 1 if stored | 0 (not queued or running, or it has one)
SET_REQUEST = """
local fields = redis.call('HMGET', KEYS[1], 'status', 'request')
if fields[1] ~= 'queued' and fields[1] ~= 'running' then return 0 end
if fields[2] and fields[2] ~= '' then return 0 end
redis.call('HSET', KEYS[1], 'request', ARGV[1])
return 1
"""
