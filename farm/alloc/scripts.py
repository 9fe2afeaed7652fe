"""Lua scripts of the slot allocator: every check and reservation of a call in one atomic step.

Each call costs in proportion to the work it asks, not to the farm's size. Expired leases are
found through their expiry index and silent agents' devices through a sorted set of liveness
deadlines, both reclaimed incrementally inside the scripts that grant new leases (correctness
needs no separate reaper). A request pinned to devices reads those devices only; any other
walks a placement index (per device class and lease kind, scored by preference, devices
without room in the kind's own dimension pushed behind ``PENALTY``) from its best end and takes
the first device that fits. Time is Redis's own clock (``TIME``) unless the caller passes one
(tests drive time explicitly). Every key comes from ``farm.keys`` (``KEYS_LUA``), and the device
policy's defaults from ``farm.alloc.policy``.
"""

from __future__ import annotations

from farm import keys
from farm.alloc import policy
from farm.alloc.devices import CPU_CLASS
from farm.luafunctions import Library

#: the keys the scripts use, as farm.keys spells them (a Lua table ``keys``)
KEYS_LUA = keys.lua(
    "DEVICES", "LEASE_EXPIRY", "LEASE_REVOKED", "DEVICE_ALIVE", "DEVICE_CLASSES", "DEVICE_SHAPES",
    "USAGE_PROJECTS", "placement", "device", "device_leases", "agent", "host", "host_devices",
    "lease", "lease_gone", "project_policy", "usage", "usage_totals", "usage_day", "usage_days",
    "usage_rolled",
)  # fmt: skip


def _lua_defaults() -> str:
    roles = ", ".join(f"{role}='{','.join(classes)}'" for role, classes in policy.DEFAULT.items())
    return f"local DEFAULT_POLICY = {{{roles}}}\nlocal GPU, CPU = '{policy.GPU}', '{CPU_CLASS}'\n"


PRELUDE = (
    KEYS_LUA
    + _lua_defaults()
    + r"""
-- placement scores are below 2; a device without room in the kind's own dimension (render
-- slots for renders, encoder sessions for streams) scores this much more, so walks stop there
local PENALTY = 10
-- a placement walk reads the index this many devices at a time
local BATCH = 16
-- each call reclaims at most this many expired leases and dead devices (the next call goes on)
local REAP = 100
local FIELDS = {'alive_until', 'host', 'class', 'vram', 'enc', 'slots', 'used_vram', 'used_enc',
                'used_slots', 'available', 'unexplained_vram', 'model', 'epl', 'energy_by',
                'token', 'unexplained_enc'}
-- the placement index of every class together, for requests that name none
local ANY = '*'


local function clock(arg)
  if arg ~= nil and arg ~= '' then return tonumber(arg) end
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

local function csv_list(text)
  local out = {}
  for item in string.gmatch(text or '', '[^,]+') do table.insert(out, item) end
  return out
end

local function device_fields(d)
  return redis.call('HMGET', keys.device(d), unpack(FIELDS))
end

-- encoder sessions in use on a device: its leases' and those no lease explains
local function encoders_used(f)
  return tonumber(f[8] or '0') + tonumber(f[16] or '0')
end

-- free memory, encoder sessions and render slots of a device's fields
local function room(f)
  return tonumber(f[4] or '0') - tonumber(f[7] or '0') - tonumber(f[11] or '0'),
         tonumber(f[5] or '0') - encoders_used(f),
         tonumber(f[6] or '0') - tonumber(f[9] or '0')
end

-- renders pack: the busiest device that fits (least free share left), so big renders find
-- room; streams spread: the least loaded encoder, then the most free memory
local function scores(f)
  local fv, fe, fs = room(f)
  local cap_v, cap_e, cap_s = tonumber(f[4] or '0'), tonumber(f[5] or '0'), tonumber(f[6] or '0')
  local r = fv / math.max(1, cap_v) + fs / math.max(1, cap_s)
  if fs <= 0 then r = r + PENALTY end
  local s = encoders_used(f) / math.max(1, cap_e) - fv / math.max(1, cap_v) / 1000
  if fe <= 0 then s = s + PENALTY end
  return r, s
end

local function index_key(class, kind)
  return keys.placement(class or '', kind)
end

-- keep a device's place in its class's indexes: there while alive and available. A change
-- that leaves encoder use alone (a render lease) moves it in the render index only: the stream
-- index's memory tie-break then lags until the next stream lease or heartbeat, which only
-- reorders equally loaded encoders (every candidate's room is checked before a grant).
-- A device on a host whose encoder budget is spent (consumer drivers cap sessions per system)
-- goes behind the stream index's penalty too, or every stream placement would walk past it.
local function host_full(host)
  local hb = redis.call('HMGET', keys.host(host or ''), 'budget', 'used_enc')
  local budget = tonumber(hb[1] or '-1')
  return budget >= 0 and tonumber(hb[2] or '0') >= budget
end

local function place(d, f, now, encoders_changed)
  local rk, sk = index_key(f[3], 'render'), index_key(f[3], 'stream')
  local ark, ask = index_key(ANY, 'render'), index_key(ANY, 'stream')
  if tonumber(f[1] or '0') >= now and f[10] == '1' then
    local r, s = scores(f)
    redis.call('ZADD', rk, r, d)
    redis.call('ZADD', ark, r, d)
    if encoders_changed then
      if s < PENALTY and host_full(f[2]) then s = s + PENALTY end
      redis.call('ZADD', sk, s, d)
      redis.call('ZADD', ask, s, d)
    end
  else
    redis.call('ZREM', rk, d)
    redis.call('ZREM', sk, d)
    redis.call('ZREM', ark, d)
    redis.call('ZREM', ask, d)
  end
end

-- Change a host's encoder sessions in use; when its budget fills up or frees (a consumer host),
-- its other devices move in the stream index (the lease's own device is placed by the caller).
local function host_encoders(host, delta, except, now)
  local hk = keys.host(host)
  local used = redis.call('HINCRBY', hk, 'used_enc', delta)
  local budget = tonumber(redis.call('HGET', hk, 'budget') or '-1')
  if budget >= 0 and (used >= budget) ~= (used - delta >= budget) then
    for _, d in ipairs(redis.call('SMEMBERS', keys.host_devices(host))) do
      if d ~= except then place(d, device_fields(d), now, true) end
    end
  end
end

-- What a lease cost, appended when it ends: device-seconds from its grant to its end (never
-- past its expiry: a dead holder is charged until its lease ran out, not until it was found),
-- and the device's measured energy over it where an agent reports NVML's energy counter.
-- ``f`` is the device's fields, already read by the caller (no extra read here). Totals are
-- integer milliseconds per class and kind, ``m|`` for leases with measured energy, ``u|`` for
-- the others (estimated from rated power when read): one increment per lease.
local function record_usage(id, l, why, now, f)
  local project = l[7]
  if not project or project == '' then project = 'unassigned' end
  local class = f[3] or 'unknown'
  local start = tonumber(l[9] or now)
  local stop = math.max(start, math.min(now, tonumber(l[10] or now)))
  local ms = stop - start
  local joules = ''
  if l[11] then joules = math.max(0, tonumber(f[13] or '0') - tonumber(l[11])) end
  redis.call('XADD', keys.usage(project), '*', 'lease', id, 'project', project,
             'job', l[8] or '', 'holder', l[12] or '', 'kind', l[6] or '', 'device', l[1],
             'class', class, 'model', f[12] or '', 'host', l[5] or '', 'vram', l[2],
             'enc', l[3], 'slots', l[4], 'start_ms', start, 'end_ms', stop,
             'energy_j', joules, 'why', why)
  local tk = keys.usage_totals(project)
  local measured = 'u|'
  if joules ~= '' then
    measured = 'm|'
    redis.call('HINCRBYFLOAT', tk, 'j|' .. class, joules)
  end
  -- a total that starts now may be the project's first: list the project then
  if redis.call('HINCRBY', tk, measured .. class .. '|' .. (l[6] or ''), ms) == ms then
    redis.call('SADD', keys.USAGE_PROJECTS, project)
  end
end

-- End a lease: give back exactly its amounts, record its usage, remember why for its late
-- holder, move its device in the placement indexes. ``now`` (epoch ms) is when it ended.
-- ``token`` (optional): end it only when it is still this one (a release).
local function free(id, why, now, token)
  local lk = keys.lease(id)
  local l = redis.call('HMGET', lk, 'device', 'vram', 'enc', 'slots', 'host', 'kind', 'project',
                       'job', 'granted', 'expires', 'epl0', 'holder', 'token')
  if token ~= nil and l[13] ~= token then return false end
  redis.call('ZREM', keys.LEASE_EXPIRY, id)
  if not l[1] then return false end
  local dk = keys.device(l[1])
  local f = device_fields(l[1])
  f[7] = tonumber(f[7] or '0') - tonumber(l[2])
  f[8] = tonumber(f[8] or '0') - tonumber(l[3])
  f[9] = tonumber(f[9] or '0') - tonumber(l[4])
  redis.call('HSET', dk, 'used_vram', f[7], 'used_enc', f[8], 'used_slots', f[9])
  if tonumber(l[3]) > 0 then
    host_encoders(l[5], 0 - tonumber(l[3]), l[1], now)
  end
  redis.call('SREM', keys.device_leases(l[1]), id)
  record_usage(id, l, why, now, f)
  redis.call('DEL', lk)
  -- the reason is kept for a holder that did not end the lease itself (expired, revoked)
  if why ~= 'released' then redis.call('SET', keys.lease_gone(id), why, 'PX', 600000) end
  if string.sub(why, 1, 7) == 'revoked' then
    redis.call('PUBLISH', keys.LEASE_REVOKED, id)
  end
  place(l[1], f, now, tonumber(l[3]) > 0)
  return true
end

local DEAD = "revoked: the device's agent stopped answering"

-- a device whose agents all went silent: its leases end, it leaves the placement indexes
local function reap_device(d, now)
  redis.call('ZREM', keys.DEVICE_ALIVE, d)
  for _, id in ipairs(redis.call('SMEMBERS', keys.device_leases(d))) do
    free(id, DEAD, now)
  end
  local dh = redis.call('HMGET', keys.device(d), 'class', 'host', 'unexplained_enc')
  local class = dh[1]
  -- the sessions no lease explained counted on its host's budget: not any more
  local foreign = tonumber(dh[3] or '0')
  if foreign > 0 then
    redis.call('HSET', keys.device(d), 'unexplained_enc', 0)
    host_encoders(dh[2], 0 - foreign, d, now)
  end
  for _, c in ipairs({class, ANY}) do
    redis.call('ZREM', index_key(c, 'render'), d)
    redis.call('ZREM', index_key(c, 'stream'), d)
  end
end

-- Extend a lease held with this token by ``ttl`` ms from ``now``: {'ok', expires}, or
-- {'gone', why} (ended already, expired, its device's agents silent: then it ends here)
local function renew(id, token, now, ttl)
  local lk = keys.lease(id)
  local l = redis.call('HMGET', lk, 'token', 'expires', 'device')
  if not l[1] or l[1] ~= token then
    return {'gone', redis.call('GET', keys.lease_gone(id)) or 'unknown lease'}
  end
  if tonumber(l[2]) < now then
    free(id, 'expired', now)
    return {'gone', 'expired'}
  end
  if tonumber(redis.call('HGET', keys.device(l[3]), 'alive_until') or '0') < now then
    free(id, DEAD, now)
    return {'gone', DEAD}
  end
  local expires = now + ttl
  redis.call('HSET', lk, 'expires', expires)
  redis.call('ZADD', keys.LEASE_EXPIRY, expires, id)
  return {'ok', expires}
end

-- work in proportion to what expired since the last call, never to the farm's size
local function reclaim(now)
  for _, id in ipairs(redis.call('ZRANGEBYSCORE', keys.LEASE_EXPIRY, '-inf', now,
                                 'LIMIT', 0, REAP)) do
    free(id, 'expired', now)
  end
  for _, d in ipairs(redis.call('ZRANGEBYSCORE', keys.DEVICE_ALIVE, '-inf', '(' .. now,
                                'LIMIT', 0, REAP)) do
    reap_device(d, now)
  end
end
"""
)

# ARGV: now|'', kind, holder, lease_id, vram, enc, slots, ttl_ms, classes csv, device ids csv,
#       preempt '1'|'0', project, job, role ('' none: an operator's request, no policy)
# -> {'ok', device, token, expires_ms, revoked} | {'never'} | {'busy'}
#    | {'forbidden', classes the role may use csv, classes refused csv}
_ACQUIRE = r"""
local now = clock(ARGV[1])
reclaim(now)
local kind = ARGV[2]
local vram, enc, slots = tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7])
local class_list, id_list = csv_list(ARGV[9]), csv_list(ARGV[10])
local classes = {}
for _, c in ipairs(class_list) do classes[c] = true end
local any_class = #class_list == 0
-- the project's device policy for the asking role: the classes it may lease (farm.alloc.policy)
local role = ARGV[14] or ''
local allowed, granted = nil, ''
if role ~= '' then
  granted = redis.call('HGET', keys.project_policy(ARGV[12]), role) or DEFAULT_POLICY[role] or ''
  allowed = {}
  for _, c in ipairs(csv_list(granted)) do allowed[c] = true end
end
local function permitted(class)
  return allowed == nil or allowed[class] == true or (allowed[GPU] == true and class ~= CPU)
end
local refused = {}
local function forbidden()
  table.sort(refused)
  return {'forbidden', granted, table.concat(refused, ',')}
end
if allowed ~= nil and #id_list == 0 then
  -- the walk, the never-fits check and preemption see the permitted classes only (a handful)
  local pool = class_list
  if any_class then pool = redis.call('SMEMBERS', keys.DEVICE_CLASSES) end
  local kept = {}
  for _, c in ipairs(pool) do
    if permitted(c) then table.insert(kept, c) else table.insert(refused, c) end
  end
  if #kept == 0 and #refused > 0 then return forbidden() end
  if #refused > 0 or not any_class then
    table.sort(kept)
    class_list, any_class, classes = kept, false, {}
    for _, c in ipairs(kept) do classes[c] = true end
  end
end
-- host -> whether its encoder budget has room for this request (devices share hosts)
local host_room = {}
local function host_ok(host)
  if enc <= 0 then return true end
  local ok = host_room[host]
  if ok == nil then
    local hb = redis.call('HMGET', keys.host(host), 'budget', 'used_enc')
    local budget = tonumber(hb[1] or '-1')
    ok = budget < 0 or tonumber(hb[2] or '0') + enc <= budget
    host_room[host] = ok
  end
  return ok
end
local function could_ever(f)
  return tonumber(f[4] or '0') >= vram and tonumber(f[5] or '0') >= enc
     and tonumber(f[6] or '0') >= slots
end
-- usable now: alive, available, room in every dimension and on its host
local function fits(d, f)
  if tonumber(f[1] or '0') < now then
    reap_device(d, now)
    host_room = {}
    return false
  end
  if f[10] ~= '1' then return false end
  local fv, fe, fs = room(f)
  return fv >= vram and fe >= enc and fs >= slots and host_ok(f[2])
end
local function score_of(f)
  local r, s = scores(f)
  if kind == 'render' then return r end
  return s
end
-- the index walk stops where the kind's own dimension runs out, when the request needs it
local stop_at = '+inf'
if (kind == 'render' and slots > 0) or (kind == 'stream' and enc > 0) then
  stop_at = '(' .. PENALTY
end

local best, best_score, best_f = nil, nil, nil
local function consider(d, f, score)
  if best_score == nil or score < best_score or (score == best_score and d < best) then
    best, best_score, best_f = d, score, f
  end
end
local ever = false
local searched = {}
if #id_list > 0 then
  -- pinned (a render worker's own device): read those devices only
  table.sort(id_list)
  for _, d in ipairs(id_list) do
    local f = device_fields(d)
    if f[3] and (any_class or classes[f[3]]) then
      if not permitted(f[3]) then
        table.insert(refused, f[3])
      else
        searched[#searched + 1] = {d, f}
        if could_ever(f) then ever = true end
        if fits(d, f) then consider(d, f, score_of(f)) end
      end
    end
  end
else
  local walk = class_list
  if any_class then walk = {ANY} end
  for _, class in ipairs(walk) do
    local key = index_key(class, kind)
    local offset = 0
    while true do
      local batch = redis.call('ZRANGEBYSCORE', key, '-inf', stop_at, 'WITHSCORES',
                               'LIMIT', offset, BATCH)
      local found = false
      for i = 1, #batch, 2 do
        local d, score = batch[i], tonumber(batch[i + 1])
        -- the first that fits is this class's best; further ones score no better
        if best_score ~= nil and score > best_score then found = true; break end
        local f = device_fields(d)
        if fits(d, f) then consider(d, f, score); found = true; break end
      end
      if found or #batch < 2 * BATCH then break end
      offset = offset + BATCH
    end
  end
end

local revoked = 0
if best == nil then
  -- whether a class the policy refuses could hold it (then the refusal says more than never)
  local refused_fits = false
  if #id_list == 0 then
    -- could any device of those classes ever hold it? (one entry per distinct shape)
    local out_of_policy = {}
    for _, c in ipairs(refused) do out_of_policy[c] = true end
    local shapes = redis.call('HGETALL', keys.DEVICE_SHAPES)
    for i = 1, #shapes, 2 do
      local c, v, e, s = string.match(shapes[i], '^(.*)|(%d+)|(%d+)|(%d+)$')
      if c and tonumber(shapes[i + 1]) > 0
         and tonumber(v) >= vram and tonumber(e) >= enc and tonumber(s) >= slots then
        if any_class or classes[c] then
          ever = true
          break
        end
        if out_of_policy[c] then refused_fits = true end
      end
    end
  end
  if not ever then
    if #refused > 0 and (#id_list > 0 or refused_fits) then return forbidden() end
    return {'never'}
  end
  if kind ~= 'stream' or ARGV[11] ~= '1' then return {'busy'} end
  -- preemption (rare: the farm is full for streams) reads every candidate device
  if #id_list == 0 then
    if any_class then class_list = {ANY} end
    for _, class in ipairs(class_list) do
      for _, d in ipairs(redis.call('ZRANGE', index_key(class, 'stream'), 0, -1)) do
        searched[#searched + 1] = {d, device_fields(d)}
      end
    end
  end
  -- could it fit if the device's render leases were revoked? fewest revocations win
  local pick, pick_n, pick_v = nil, nil, nil
  for _, entry in ipairs(searched) do
    local d, f = entry[1], entry[2]
    if tonumber(f[1] or '0') >= now and f[10] == '1' and host_ok(f[2]) then
      local fv, fe, fs = room(f)
      local gv, ge, gs, renders = 0, 0, 0, {}
      for _, id in ipairs(redis.call('SMEMBERS', keys.device_leases(d))) do
        local l = redis.call('HMGET', keys.lease(id), 'kind', 'vram', 'enc', 'slots', 'token')
        if l[1] == 'render' then
          gv, ge, gs = gv + tonumber(l[2]), ge + tonumber(l[3]), gs + tonumber(l[4])
          table.insert(renders, {id, tonumber(l[5]), tonumber(l[2]), tonumber(l[3]), tonumber(l[4])})
        end
      end
      if fv + gv >= vram and fe + ge >= enc and fs + gs >= slots then
        if pick == nil or #renders < pick_n or (#renders == pick_n and d < pick) then
          pick, pick_n, pick_v = d, #renders, {renders, fv, fe, fs}
        end
      end
    end
  end
  if pick == nil then return {'busy'} end
  local renders, fv, fe, fs = pick_v[1], pick_v[2], pick_v[3], pick_v[4]
  -- newest renders go first
  table.sort(renders, function(a, b) return a[2] > b[2] end)
  for _, r in ipairs(renders) do
    if fv >= vram and fe >= enc and fs >= slots then break end
    free(r[1], 'revoked: preempted by a stream', now)
    fv, fe, fs = fv + r[3], fe + r[4], fs + r[5]
    revoked = revoked + 1
  end
  best, best_f = pick, device_fields(pick)
end
local dk = keys.device(best)
local token = tonumber(best_f[15] or '0') + 1
local expires = now + tonumber(ARGV[8])
local id = ARGV[4]
local lk = keys.lease(id)
redis.call('HSET', lk, 'holder', ARGV[3], 'kind', kind, 'device', best,
           'vram', vram, 'enc', enc, 'slots', slots, 'host', best_f[2], 'token', token,
           'expires', expires, 'project', ARGV[12], 'granted', now, 'job', ARGV[13] or '')
-- where an agent reports the device's energy counter, the lease's share of it starts here
if best_f[14] then redis.call('HSET', lk, 'epl0', best_f[13] or '0') end
-- (lease ids are fresh uuids: no earlier ``:gone`` record to clear)
redis.call('ZADD', keys.LEASE_EXPIRY, expires, id)
redis.call('SADD', keys.device_leases(best), id)
best_f[7] = tonumber(best_f[7] or '0') + vram
best_f[8] = tonumber(best_f[8] or '0') + enc
best_f[9] = tonumber(best_f[9] or '0') + slots
redis.call('HSET', dk, 'used_vram', best_f[7], 'used_enc', best_f[8], 'used_slots', best_f[9],
           'token', token)
if enc > 0 then host_encoders(best_f[2], enc, best, now) end
place(best, best_f, now, enc > 0)
return {'ok', best, token, expires, revoked}
"""

# ARGV: now|'', lease_id, token, ttl_ms   -> {'ok', expires} | {'gone', why}
_RENEW = r"""
return renew(ARGV[2], ARGV[3], clock(ARGV[1]), tonumber(ARGV[4]))
"""

# ARGV: now|'', ttl_ms, then lease_id, token for each lease (a process's leases renewed in one
# call: a stream service's sessions)   -> {status, expires | why} for each, flat, in order
_RENEW_MANY = r"""
local now, ttl = clock(ARGV[1]), tonumber(ARGV[2])
local out = {}
for i = 3, #ARGV, 2 do
  local r = renew(ARGV[i], ARGV[i + 1], now, ttl)
  out[#out + 1] = r[1]
  out[#out + 1] = r[2]
end
return out
"""

# ARGV: lease_id, token, now|''   -> 1 released | 0 not held
_RELEASE = r"""
if free(ARGV[1], 'released', clock(ARGV[3]), ARGV[2]) then return 1 end
return 0
"""

# ARGV: now|'', lease_id, token   -> 1 when the lease is held and current (the fencing check)
_CHECK = r"""
local now = clock(ARGV[1])
local l = redis.call('HMGET', keys.lease(ARGV[2]), 'token', 'expires', 'device')
if l[1] ~= ARGV[3] or tonumber(l[2]) < now then return 0 end
-- a lease on a device whose agents all went silent no longer counts, reclaimed or not
if tonumber(redis.call('HGET', keys.device(l[3]), 'alive_until') or '0') < now then return 0 end
return 1
"""

# ARGV: now|'', device ids csv ('' every device)
# -> JSON [now, [[device id, {field: value}, [[lease id, {field: value}], ...]], ...]]
# One atomic read, so counters and leases always agree (a pipeline could interleave a grant).
_SNAPSHOT = r"""
local now = clock(ARGV[1])
-- what expired leaves before it is shown: a killed holder's leases and a silent agent's devices
-- are not listed until the next grant (`farm gpus` on an idle farm showed them for minutes)
reclaim(now)
-- what expired beyond reclaim's bound (a burst of dead holders) is held by nobody either: it is
-- neither listed nor counted in its device's use, and a later call reclaims it
local AMOUNTS = {{'used_vram', 'vram'}, {'used_enc', 'enc'}, {'used_slots', 'slots'}}
local out = {}
local devices = csv_list(ARGV[2])
if #devices == 0 then devices = redis.call('SMEMBERS', keys.DEVICES) end
table.sort(devices)
for _, d in ipairs(devices) do
  local dk = keys.device(d)
  local fields = {}
  local flat = redis.call('HGETALL', dk)
  for i = 1, #flat, 2 do fields[flat[i]] = flat[i + 1] end
  local leases = {}
  local ids = redis.call('SMEMBERS', keys.device_leases(d))
  table.sort(ids)
  for _, id in ipairs(ids) do
    local row = {}
    local lflat = redis.call('HGETALL', keys.lease(id))
    for i = 1, #lflat, 2 do row[lflat[i]] = lflat[i + 1] end
    if row['expires'] and tonumber(row['expires']) <= now then
      for _, a in ipairs(AMOUNTS) do
        fields[a[1]] = tostring(tonumber(fields[a[1]] or '0') - tonumber(row[a[2]] or '0'))
      end
    else
      table.insert(leases, {id, row})
    end
  end
  if #flat > 0 then table.insert(out, {d, fields, leases}) end
end
return cjson.encode({now, out})
"""

# ARGV: now|'', agent, ttl_ms, host, host_budget (-1 none), devices JSON, tolerance MiB,
#       tolerance fraction
# (register and heartbeat are one idempotent call: capacities may change between beats; a
# device offered by several agents, a render worker and a stream service, lives while any beats)
# A device offered with the memory NVML sees in use (``observed_vram_mib``: an agent that
# reconciles its GPUs) has its unexplained memory worked out here, against its leases at this
# instant (farm.alloc.reconcile: beyond the tolerance, what no lease explains is held back),
# and so have its encoder sessions (``observed_encoder_sessions``: those open beyond its
# leases' are held back on the device and counted on its host's budget, which the driver's
# per-system cap counts them on too); its leases as they were then are returned for the
# agent's own reconciliation:
# -> {device id, leased VRAM MiB, leased encoder sessions, leases, ...} for those devices
_REGISTER = r"""
local now = clock(ARGV[1])
local until_ms = now + tonumber(ARGV[3])
local offers = cjson.decode(ARGV[6])
local views = {}
local reclaimed = false
for _, d in ipairs(offers) do
  -- the pool as an agent that reconciles reads it: what expired is reclaimed first
  if d['observed_vram_mib'] then reclaim(now); reclaimed = true; break end
end
redis.call('SET', keys.agent(ARGV[2]), 'alive', 'PX', ARGV[3])
redis.call('HSET', keys.host(ARGV[4]), 'budget', ARGV[5])
redis.call('HSETNX', keys.host(ARGV[4]), 'used_enc', 0)
for _, d in ipairs(offers) do
  local dk = keys.device(d['id'])
  local old = redis.call('HMGET', dk, 'alive_until', 'class', 'shape', 'offer', 'used_vram',
                         'used_enc', 'unexplained_enc')
  local alive_until = math.max(tonumber(old[1] or '0'), until_ms)
  redis.call('HSET', dk, 'alive_until', alive_until)
  redis.call('ZADD', keys.DEVICE_ALIVE, alive_until, d['id'])
  local class = d['device_class']
  local unexplained = d['unexplained_vram_mib']
  local observed = d['observed_vram_mib']
  if observed then
    local leased = tonumber(old[5] or '0')
    local allowed = leased + tonumber(ARGV[7]) + math.floor(leased * tonumber(ARGV[8]))
    unexplained = 0
    if observed > allowed then unexplained = observed - leased end
    table.insert(views, d['id'])
    table.insert(views, leased)
    table.insert(views, tonumber(old[6] or '0'))
    table.insert(views, redis.call('SCARD', keys.device_leases(d['id'])))
  end
  -- kept as it was where this agent does not read the sessions (another one may)
  local foreign = tonumber(old[7] or '0')
  local sessions = d['observed_encoder_sessions']
  if sessions then foreign = math.max(0, sessions - tonumber(old[6] or '0')) end
  if foreign ~= tonumber(old[7] or '0') then
    redis.call('HSET', dk, 'unexplained_enc', foreign)
    host_encoders(ARGV[4], foreign - tonumber(old[7] or '0'), d['id'], now)
  end
  local offer = table.concat({ARGV[2], ARGV[4], class, d['model'], d['vram_mib'],
                              d['encoder_sessions'], d['render_slots'], d['available'],
                              d['unavailable_reason'], unexplained, foreign}, '|')
  -- a beat that changes nothing of a live device only moves its deadline (three calls)
  local changed = old[4] ~= offer or tonumber(old[1] or '0') < now
  if changed then
    redis.call('HSET', dk, 'agent', ARGV[2], 'host', ARGV[4], 'class', class,
               'model', d['model'], 'vram', d['vram_mib'], 'enc', d['encoder_sessions'],
               'slots', d['render_slots'], 'available', d['available'],
               'unavailable_reason', d['unavailable_reason'],
               'unexplained_vram', unexplained, 'offer', offer)
    for _, field in ipairs({'used_vram', 'used_enc', 'used_slots', 'token'}) do
      redis.call('HSETNX', dk, field, 0)
    end
    if old[2] and old[2] ~= class then
      redis.call('ZREM', index_key(old[2], 'render'), d['id'])
      redis.call('ZREM', index_key(old[2], 'stream'), d['id'])
    end
    redis.call('SADD', keys.DEVICE_CLASSES, class)
    redis.call('SADD', keys.host_devices(ARGV[4]), d['id'])
    -- the count of devices of each shape answers "could this ever fit?" without a scan
    local shape = class .. '|' .. d['vram_mib'] .. '|' .. d['encoder_sessions'] .. '|'
                  .. d['render_slots']
    if old[3] ~= shape then
      if old[3] and redis.call('HINCRBY', keys.DEVICE_SHAPES, old[3], -1) <= 0 then
        redis.call('HDEL', keys.DEVICE_SHAPES, old[3])
      end
      redis.call('HINCRBY', keys.DEVICE_SHAPES, shape, 1)
      redis.call('HSET', dk, 'shape', shape)
    end
  end
  -- NVML's energy counter (J since the driver loaded; -1: not reported). One agent per device
  -- reports it (another takes over when it dies); each increase is split evenly between the
  -- device's leases (``epl``: energy per lease, cumulative) or counted idle when it has none.
  local e = tonumber(d['energy_j'] or -1)
  if e >= 0 then
    local by = redis.call('HGET', dk, 'energy_by')
    if by ~= ARGV[2] and (not by or redis.call('EXISTS', keys.agent(by)) == 0) then
      redis.call('HSET', dk, 'energy_by', ARGV[2], 'energy_last', e)
    elseif by == ARGV[2] then
      local delta = e - tonumber(redis.call('HGET', dk, 'energy_last') or e)
      if delta > 0 then
        local n = redis.call('SCARD', keys.device_leases(d['id']))
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
  if changed then
    redis.call('SADD', keys.DEVICES, d['id'])
    place(d['id'], device_fields(d['id']), now, true)
  end
end
-- Every beat also reclaims what expired (after this agent's own devices moved their deadlines,
-- where it did not above, at the same instant): a holder that died after the farm's last grant
-- would otherwise keep its lease, unrecorded in usage, until the next grant (seen in the chaos
-- suite: a worker killed as it was granted).
if not reclaimed then reclaim(now) end
return views
"""

#: the scripts above as one Redis function library (farm.luafunctions): the prelude is defined
#: once when the library loads, not on every call
LIBRARY = Library(
    "alloc",
    PRELUDE,
    {"acquire": _ACQUIRE, "renew": _RENEW, "renew_many": _RENEW_MANY, "release": _RELEASE,
     "check": _CHECK, "snapshot": _SNAPSHOT, "register": _REGISTER},
)  # fmt: skip

# ARGV: project, the id of the newest raw entry to roll up (ms), limit
# The sweep's usage roll-up: the project's oldest raw entries (at most `limit`, none newer than
# ARGV[2]) are added to their hours' totals (keys.usage_day; a lease across hours is split by
# its time in each, its measured energy in proportion) and trimmed from the stream in the same
# step, so an entry counts in exactly one of the two. Returns how many were rolled up.
ROLL_UP_USAGE = (
    KEYS_LUA
    + """
local project = ARGV[1]
local sk = keys.usage(project)
local entries = redis.call('XRANGE', sk, '-', ARGV[2], 'COUNT', tonumber(ARGV[3]))
if #entries == 0 then return 0 end
local HOUR, DAY = 3600000, 86400000
local function field(h, f, metric)
  local day = math.floor(h / DAY)
  local dk = keys.usage_day(project, string.format('%d', day))
  redis.call('ZADD', keys.usage_days(project), day, string.format('%d', day))
  return dk, string.format('%d', (h - day * DAY) / HOUR) .. '|' .. (f['class'] or '') .. '|'
    .. (f['kind'] or '') .. '|' .. (f['job'] or '') .. '|' .. metric
end
for _, entry in ipairs(entries) do
  local f = {}
  for i = 1, #entry[2], 2 do f[entry[2][i]] = entry[2][i + 1] end
  local start = math.floor(tonumber(f['start_ms'] or '0'))
  local stop = math.floor(tonumber(f['end_ms'] or '0'))
  local joules = nil
  if f['energy_j'] and f['energy_j'] ~= '' then joules = tonumber(f['energy_j']) end
  local span = stop - start
  local h = math.floor(math.min(start, stop) / HOUR) * HOUR
  if span <= 0 then h = math.floor(stop / HOUR) * HOUR end
  local first = h
  repeat
    local ms = math.max(0, math.min(stop, h + HOUR) - math.max(start, h))
    if ms > 0 or span <= 0 then
      -- counted in each hour it spans, and as continued in each but its first, so that a run
      -- of hours counts it once (n summed, c of all but the run's first subtracted)
      local dk, name = field(h, f, 'n')
      redis.call('HINCRBY', dk, name, 1)
      if h > first then
        dk, name = field(h, f, 'c')
        redis.call('HINCRBY', dk, name, 1)
      end
    end
    if ms > 0 then
      local dk, name = field(h, f, 'ms')
      redis.call('HINCRBY', dk, name, ms)
      if not joules then
        dk, name = field(h, f, 'u')
        redis.call('HINCRBY', dk, name, ms)
      end
    end
    if joules and (ms > 0 or span <= 0) then
      local share = 1
      if span > 0 then share = ms / span end
      local dk, name = field(h, f, 'j')
      redis.call('HINCRBYFLOAT', dk, name, joules * share)
    end
    h = h + HOUR
  until h >= stop
end
local id = entries[#entries][1]
local ms, seq = string.match(id, '^(%d+)-(%d+)$')
redis.call('XTRIM', sk, 'MINID', '=', ms .. '-' .. string.format('%d', tonumber(seq) + 1))
redis.call('SET', keys.usage_rolled(project), id)
return #entries
"""
)
