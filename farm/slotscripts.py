"""Lua scripts of the slot allocator: every check and reservation of a call in one atomic step.

Expired leases, and the leases of devices whose agent went silent, are reclaimed inside the same
scripts that grant new ones, so correctness needs no separate reaper. Time is Redis's own clock
(``TIME``) unless the caller passes one (tests drive time explicitly).
"""

from __future__ import annotations

PRELUDE = r"""
local P = 'tessera:'

local function clock(arg)
  if arg ~= nil and arg ~= '' then return tonumber(arg) end
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

local function csv_set(text)
  local out = {}
  for item in string.gmatch(text or '', '[^,]+') do out[item] = true end
  return out
end

-- What a lease cost, appended when it ends: device-seconds from its grant to its end (never
-- past its expiry: a dead holder is charged until its lease ran out, not until it was found),
-- and the device's measured energy over it where an agent reports NVML's energy counter.
local function record_usage(id, l, why, now)
  local project = l[7]
  if not project or project == '' then project = 'unassigned' end
  local d = redis.call('HMGET', P .. 'device:' .. l[1], 'class', 'model', 'epl')
  local class = d[1] or 'unknown'
  local start = tonumber(l[9] or now)
  local stop = math.max(start, math.min(now, tonumber(l[10] or now)))
  local secs = (stop - start) / 1000
  local joules = ''
  if l[11] then joules = math.max(0, tonumber(d[3] or '0') - tonumber(l[11])) end
  redis.call('XADD', P .. 'usage:' .. project, '*', 'lease', id, 'project', project,
             'job', l[8] or '', 'holder', l[12] or '', 'kind', l[6] or '', 'device', l[1],
             'class', class, 'model', d[2] or '', 'host', l[5] or '', 'vram', l[2],
             'enc', l[3], 'slots', l[4], 'start_ms', start, 'end_ms', stop,
             'energy_j', joules, 'why', why)
  redis.call('SADD', P .. 'usage-projects', project)
  local tk = P .. 'usage:' .. project .. ':totals'
  redis.call('HINCRBYFLOAT', tk, 's|' .. class .. '|' .. (l[6] or ''), secs)
  if joules == '' then
    redis.call('HINCRBYFLOAT', tk, 'u|' .. class, secs)
  else
    redis.call('HINCRBYFLOAT', tk, 'j|' .. class, joules)
  end
end

-- End a lease: give back exactly its amounts, record its usage, remember why for its late
-- holder. ``now`` (epoch ms) is when it ended.
local function free(id, why, now)
  local lk = P .. 'lease:' .. id
  local l = redis.call('HMGET', lk, 'device', 'vram', 'enc', 'slots', 'host', 'kind', 'project',
                       'job', 'granted', 'expires', 'epl0', 'holder')
  redis.call('ZREM', P .. 'lease-expiry', id)
  if not l[1] then return false end
  local dk = P .. 'device:' .. l[1]
  redis.call('HINCRBY', dk, 'used_vram', 0 - tonumber(l[2]))
  redis.call('HINCRBY', dk, 'used_enc', 0 - tonumber(l[3]))
  redis.call('HINCRBY', dk, 'used_slots', 0 - tonumber(l[4]))
  if tonumber(l[3]) > 0 then
    redis.call('HINCRBY', P .. 'host:' .. l[5], 'used_enc', 0 - tonumber(l[3]))
  end
  redis.call('SREM', dk .. ':leases', id)
  record_usage(id, l, why, now)
  redis.call('DEL', lk)
  -- the reason is kept for a holder that did not end the lease itself (expired, revoked)
  if why ~= 'released' then redis.call('SET', lk .. ':gone', why, 'PX', 600000) end
  if string.sub(why, 1, 7) == 'revoked' then
    redis.call('PUBLISH', P .. 'lease-revoked', id)
  end
  return true
end

local function reclaim_expired(now)
  for _, id in ipairs(redis.call('ZRANGEBYSCORE', P .. 'lease-expiry', '-inf', now)) do
    free(id, 'expired', now)
  end
end
"""

# ARGV: now|'', kind, holder, lease_id, vram, enc, slots, ttl_ms, classes csv, device ids csv,
#       preempt '1'|'0', project, job
# -> {'ok', device, token, expires_ms, revoked} | {'never'} | {'busy'}
ACQUIRE = (
    PRELUDE
    + r"""
local now = clock(ARGV[1])
reclaim_expired(now)
local kind = ARGV[2]
local vram, enc, slots = tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7])
local classes, ids = csv_set(ARGV[9]), csv_set(ARGV[10])
local any_class, any_id = next(classes) == nil, next(ids) == nil
local best, best_score, best_f = nil, nil, nil
local ever = false
local victims_of = {}
-- host -> whether its encoder budget has room for this request (devices share hosts)
local host_room = {}
local devices = redis.call('SMEMBERS', P .. 'devices')
table.sort(devices)
for _, d in ipairs(devices) do
  local dk = P .. 'device:' .. d
  local f = redis.call('HMGET', dk, 'alive_until', 'host', 'class', 'vram', 'enc', 'slots',
                       'used_vram', 'used_enc', 'used_slots', 'available', 'unexplained_vram')
  -- alive while any agent offering it keeps beating
  local alive = tonumber(f[1] or '0') >= now
  if not alive then
    for _, id in ipairs(redis.call('SMEMBERS', dk .. ':leases')) do
      free(id, "revoked: the device's agent stopped answering", now)
      -- freeing gave encoder sessions back to a host: read its budget again
      host_room = {}
    end
  end
  local cap_v, cap_e, cap_s = tonumber(f[4]), tonumber(f[5]), tonumber(f[6])
  local wanted = (any_class or classes[f[3]]) and (any_id or ids[d])
  if wanted and cap_v >= vram and cap_e >= enc and cap_s >= slots then ever = true end
  if wanted and alive and f[10] == '1' then
    local fv = cap_v - tonumber(f[7]) - tonumber(f[11] or '0')
    local fe = cap_e - tonumber(f[8])
    local fs = cap_s - tonumber(f[9])
    local host_ok = true
    if enc > 0 then
      host_ok = host_room[f[2]]
      if host_ok == nil then
        local hb = redis.call('HMGET', P .. 'host:' .. f[2], 'budget', 'used_enc')
        local budget = tonumber(hb[1] or '-1')
        host_ok = budget < 0 or tonumber(hb[2] or '0') + enc <= budget
        host_room[f[2]] = host_ok
      end
    end
    if host_ok and fv >= vram and fe >= enc and fs >= slots then
      local score
      if kind == 'render' then
        -- pack: the busiest device that fits (least free share left), so big renders find room
        score = fv / math.max(1, cap_v) + fs / math.max(1, cap_s)
      else
        -- spread: the least loaded encoder, then the most free memory
        score = tonumber(f[8]) / math.max(1, cap_e) - fv / math.max(1, cap_v) / 1000
      end
      if best_score == nil or score < best_score then best, best_score, best_f = d, score, f end
    elseif host_ok and kind == 'stream' and ARGV[11] == '1' then
      -- could it fit if the device's render leases were revoked?
      local gv, ge, gs, renders = 0, 0, 0, {}
      for _, id in ipairs(redis.call('SMEMBERS', dk .. ':leases')) do
        local l = redis.call('HMGET', P .. 'lease:' .. id, 'kind', 'vram', 'enc', 'slots', 'token')
        if l[1] == 'render' then
          gv, ge, gs = gv + tonumber(l[2]), ge + tonumber(l[3]), gs + tonumber(l[4])
          table.insert(renders, {id, tonumber(l[5]), tonumber(l[2]), tonumber(l[3]), tonumber(l[4])})
        end
      end
      if fv + gv >= vram and fe + ge >= enc and fs + gs >= slots then
        victims_of[d] = {renders, fv, fe, fs, f}
      end
    end
  end
end
local revoked = 0
if best == nil then
  if not ever then return {'never'} end
  -- preempt on the device that needs the fewest revocations; newest renders go first
  local pick, pick_n = nil, nil
  for d, v in pairs(victims_of) do
    if pick == nil or #v[1] < pick_n or (#v[1] == pick_n and d < pick) then pick, pick_n = d, #v[1] end
  end
  if pick == nil then return {'busy'} end
  local v = victims_of[pick]
  local renders, fv, fe, fs = v[1], v[2], v[3], v[4]
  table.sort(renders, function(a, b) return a[2] > b[2] end)
  for _, r in ipairs(renders) do
    if fv >= vram and fe >= enc and fs >= slots then break end
    free(r[1], 'revoked: preempted by a stream', now)
    fv, fe, fs = fv + r[3], fe + r[4], fs + r[5]
    revoked = revoked + 1
  end
  best, best_f = pick, v[5]
end
local dk = P .. 'device:' .. best
local token = redis.call('HINCRBY', dk, 'token', 1)
local expires = now + tonumber(ARGV[8])
local id = ARGV[4]
redis.call('HSET', P .. 'lease:' .. id, 'holder', ARGV[3], 'kind', kind, 'device', best,
           'vram', vram, 'enc', enc, 'slots', slots, 'host', best_f[2], 'token', token,
           'expires', expires, 'project', ARGV[12], 'granted', now, 'job', ARGV[13] or '')
-- where an agent reports the device's energy counter, the lease's share of it starts here
local energy = redis.call('HMGET', dk, 'energy_by', 'epl')
if energy[1] then redis.call('HSET', P .. 'lease:' .. id, 'epl0', energy[2] or '0') end
redis.call('DEL', P .. 'lease:' .. id .. ':gone')
redis.call('ZADD', P .. 'lease-expiry', expires, id)
redis.call('SADD', dk .. ':leases', id)
redis.call('HINCRBY', dk, 'used_vram', vram)
redis.call('HINCRBY', dk, 'used_enc', enc)
redis.call('HINCRBY', dk, 'used_slots', slots)
if enc > 0 then redis.call('HINCRBY', P .. 'host:' .. best_f[2], 'used_enc', enc) end
return {'ok', best, token, expires, revoked}
"""
)

# ARGV: now|'', lease_id, token, ttl_ms   -> {'ok', expires} | {'gone', why}
RENEW = (
    PRELUDE
    + r"""
local now = clock(ARGV[1])
local lk = P .. 'lease:' .. ARGV[2]
local l = redis.call('HMGET', lk, 'token', 'expires', 'device')
if not l[1] or l[1] ~= ARGV[3] then
  return {'gone', redis.call('GET', lk .. ':gone') or 'unknown lease'}
end
if tonumber(l[2]) < now then
  free(ARGV[2], 'expired', now)
  return {'gone', 'expired'}
end
if tonumber(redis.call('HGET', P .. 'device:' .. l[3], 'alive_until') or '0') < now then
  free(ARGV[2], "revoked: the device's agent stopped answering", now)
  return {'gone', "revoked: the device's agent stopped answering"}
end
local expires = now + tonumber(ARGV[4])
redis.call('HSET', lk, 'expires', expires)
redis.call('ZADD', P .. 'lease-expiry', expires, ARGV[2])
return {'ok', expires}
"""
)

# ARGV: lease_id, token, now|''   -> 1 released | 0 not held
RELEASE = (
    PRELUDE
    + r"""
if redis.call('HGET', P .. 'lease:' .. ARGV[1], 'token') ~= ARGV[2] then return 0 end
free(ARGV[1], 'released', clock(ARGV[3]))
return 1
"""
)

# ARGV: now|'', lease_id, token   -> 1 when the lease is held and current (the fencing check)
CHECK = (
    PRELUDE
    + r"""
local now = clock(ARGV[1])
local l = redis.call('HMGET', P .. 'lease:' .. ARGV[2], 'token', 'expires', 'device')
if l[1] ~= ARGV[3] or tonumber(l[2]) < now then return 0 end
-- a lease on a device whose agents all went silent no longer counts, reclaimed or not
if tonumber(redis.call('HGET', P .. 'device:' .. l[3], 'alive_until') or '0') < now then return 0 end
return 1
"""
)

# ARGV: now|''  -> JSON [now, [[device id, {field: value}, [[lease id, {field: value}], ...]], ...]]
# One atomic read, so counters and leases always agree (a pipeline could interleave a grant).
SNAPSHOT = (
    PRELUDE
    + r"""
local now = clock(ARGV[1])
local out = {}
local devices = redis.call('SMEMBERS', P .. 'devices')
table.sort(devices)
for _, d in ipairs(devices) do
  local dk = P .. 'device:' .. d
  local fields = {}
  local flat = redis.call('HGETALL', dk)
  for i = 1, #flat, 2 do fields[flat[i]] = flat[i + 1] end
  local leases = {}
  local ids = redis.call('SMEMBERS', dk .. ':leases')
  table.sort(ids)
  for _, id in ipairs(ids) do
    local row = {}
    local lflat = redis.call('HGETALL', P .. 'lease:' .. id)
    for i = 1, #lflat, 2 do row[lflat[i]] = lflat[i + 1] end
    table.insert(leases, {id, row})
  end
  table.insert(out, {d, fields, leases})
end
return cjson.encode({now, out})
"""
)

# ARGV: now|'', agent, ttl_ms, host, host_budget (-1 none), devices JSON
# (register and heartbeat are one idempotent call: capacities may change between beats; a
# device offered by several agents, a render worker and a stream service, lives while any beats)
REGISTER = (
    PRELUDE
    + r"""
local now = clock(ARGV[1])
local until_ms = now + tonumber(ARGV[3])
redis.call('SET', P .. 'agent:' .. ARGV[2], 'alive', 'PX', ARGV[3])
redis.call('HSET', P .. 'host:' .. ARGV[4], 'budget', ARGV[5])
redis.call('HSETNX', P .. 'host:' .. ARGV[4], 'used_enc', 0)
for _, d in ipairs(cjson.decode(ARGV[6])) do
  local dk = P .. 'device:' .. d['id']
  if tonumber(redis.call('HGET', dk, 'alive_until') or '0') < until_ms then
    redis.call('HSET', dk, 'alive_until', until_ms)
  end
  redis.call('HSET', dk, 'agent', ARGV[2], 'host', ARGV[4], 'class', d['device_class'],
             'model', d['model'], 'vram', d['vram_mib'], 'enc', d['encoder_sessions'],
             'slots', d['render_slots'], 'available', d['available'],
             'unavailable_reason', d['unavailable_reason'],
             'unexplained_vram', d['unexplained_vram_mib'])
  for _, field in ipairs({'used_vram', 'used_enc', 'used_slots', 'token'}) do
    redis.call('HSETNX', dk, field, 0)
  end
  -- NVML's energy counter (J since the driver loaded; -1: not reported). One agent per device
  -- reports it (another takes over when it dies); each increase is split evenly between the
  -- device's leases (``epl``: energy per lease, cumulative) or counted idle when it has none.
  local e = tonumber(d['energy_j'] or -1)
  if e >= 0 then
    local by = redis.call('HGET', dk, 'energy_by')
    if by ~= ARGV[2] and (not by or redis.call('EXISTS', P .. 'agent:' .. by) == 0) then
      redis.call('HSET', dk, 'energy_by', ARGV[2], 'energy_last', e)
    elseif by == ARGV[2] then
      local delta = e - tonumber(redis.call('HGET', dk, 'energy_last') or e)
      if delta > 0 then
        local n = redis.call('SCARD', dk .. ':leases')
        if n > 0 then
          redis.call('HINCRBYFLOAT', dk, 'epl', delta / n)
        else
          redis.call('HINCRBYFLOAT', dk, 'energy_idle', delta)
        end
      end
      -- a smaller reading is a counter reset (driver reload): start again from it
      redis.call('HSET', dk, 'energy_last', e)
    end
  end
  redis.call('SADD', P .. 'devices', d['id'])
end
return 1
"""
)
