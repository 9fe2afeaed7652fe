"""Lua scripts that move jobs and tiles between states atomically inside Redis.

Each script is one compare-and-set: it checks the record is where the caller believes (state and
attempt), moves it, updates the counters and appends the progress event, all in one step, so two
workers can never both commit a tile and a stale attempt can never commit at all. The allowed
transitions come from ``farm.states`` (rendered into a Lua prelude), so Python and Lua share one
table; the keys a script finds by name come from ``farm.keys`` (``KEYS_LUA``).
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum
from typing import TypeVar

from farm import keys
from farm.luafunctions import Library
from farm.states import JOB_TRANSITIONS, TILE_TRANSITIONS
from farm.webhooks import outbox

S = TypeVar("S", bound=StrEnum)


def _lua_moves(table: Mapping[S, frozenset[S]]) -> str:
    """The allowed moves as one Lua string ``|old>new|...|``: a constant, where a table would
    be built again on every call of every script."""
    pairs = sorted(f"{old.value}>{new.value}" for old, news in table.items() for new in news)
    return "|" + "|".join(pairs) + "|"


#: the keys the scripts find by name (not given in KEYS), as farm.keys spells them
KEYS_LUA = keys.lua(
    "job",
    "tiles",
    "events",
    "assembling",
    "lease",
    "frame_counts",
    "delivered",
    "JOBS_ENDED",
    "dependents",
    "blocklist",
    "worker_blocked",
    "WAITING",
    "RELEASED",
    "WEBHOOK_OUTBOX",
    "WEBHOOK_PROJECTS",
    "project_events",
)

#: What waiting for other jobs does inside the prelude (after ``job_move`` and ``end_tiles``):
#: a released job is queued, its tiles named in REQUEUED as due at once (the sweep pushes those
#: the releaser did not) and its id put on RELEASED for whoever pushes them now
#: (farm.dependencies); a job that ends counts down or fails the jobs waiting for it.
DEPENDENCIES_LUA = """
local function release_job(jid, ts)
  if not job_move(keys.job(jid), keys.events(jid), jid, 'queued', ts, '') then return end
  redis.call('ZREM', keys.WAITING, jid)
  local all = redis.call('HGETALL', keys.tiles(jid))
  for i = 1, #all, 2 do
    local _, colons = string.gsub(all[i], ':', '')
    if colons == 1 and all[i + 1] == 'queued' then
      redis.call('ZADD', REQUEUED, ts, jid .. '|' .. all[i])
    end
  end
  redis.call('RPUSH', keys.RELEASED, jid)
end

-- a dependency that is not done: nil while it may still finish, else why the waiter fails
local function dependency_lost(d)
  local st = redis.call('HGET', keys.job(d), 'state')
  if not st then return 'dependency ' .. d .. ' no longer exists' end
  if st == 'failed' or st == 'canceled' then return 'dependency ' .. d .. ' ' .. st end
  return nil
end

local function fail_waiting(jid, ts, why)
  redis.call('ZREM', keys.WAITING, jid)
  job_move(keys.job(jid), keys.events(jid), jid, 'failed', ts, why)
  end_tiles(jid)
end

-- done counts a waiting job's dependencies down (released at 0); failed or canceled fails it
-- with the reason, and its own dependents with it (job_move calls this again for them)
on_final = function(jid, new, ts)
  local dk = keys.dependents(jid)
  for _, d in ipairs(redis.call('SMEMBERS', dk)) do
    local djk = keys.job(d)
    if redis.call('HGET', djk, 'state') == 'waiting' then
      if new ~= 'done' then
        fail_waiting(d, ts, 'dependency ' .. jid .. ' ' .. new)
      elseif redis.call('HINCRBY', djk, 'deps_left', -1) <= 0 then
        release_job(d, ts)
      end
    end
  end
  redis.call('DEL', dk)
end

-- count a waiting job's dependencies again from its spec: fail, release or wait
local function check_waiting(jid, ts)
  local jk = keys.job(jid)
  local spec = cjson.decode(redis.call('HGET', jk, 'spec'))
  local left = 0
  for _, d in ipairs(spec['depends_on'] or {}) do
    if redis.call('HGET', keys.job(d), 'state') ~= 'done' then
      local why = dependency_lost(d)
      if why then
        fail_waiting(jid, ts, why)
        return 'failed'
      end
      redis.call('SADD', keys.dependents(d), jid)
      left = left + 1
    end
  end
  redis.call('HSET', jk, 'deps_left', left)
  if left == 0 then
    release_job(jid, ts)
    return 'released'
  end
  redis.call('ZADD', keys.WAITING, 'NX', ts, jid)
  return 'waiting'
end
"""

PRELUDE = f"""
{KEYS_LUA}
{outbox.NOTIFY_LUA}
local JOB_MOVES = '{_lua_moves(JOB_TRANSITIONS)}'
local TILE_MOVES = '{_lua_moves(TILE_TRANSITIONS)}'
local FINAL = {{done=true, failed=true, canceled=true}}

local function allowed(moves, old, new)
  return old ~= nil and old ~= false
     and string.find(moves, '|' .. old .. '>' .. new .. '|', 1, true) ~= nil
end
-- the sweep's indexes: rendering tiles by lease deadline, assembled frames by assembly deadline,
-- requeued tiles by when they were requeued (until their push to the queue is confirmed)
local TILE_DEADLINES = '{keys.TILE_DEADLINES}'
local FRAME_DEADLINES = '{keys.FRAME_DEADLINES}'
local REQUEUED = '{keys.REQUEUED}'

local function event(evk, fields)
  redis.call('XADD', evk, 'MAXLEN', '~', 100000, '*', unpack(fields))
end

-- The same event on the job's project feed (the jobs list's live refresh), capped by length
local function project_event(jk, fields)
  local spec = redis.call('HGET', jk, 'spec')
  if not spec then return end
  local project = cjson.decode(spec)['project']
  if type(project) == 'string' then
    redis.call('XADD', keys.project_events(project), 'MAXLEN', '~', 1000, '*', unpack(fields))
  end
end

-- what a job's end does to the jobs waiting for it (defined below, farm.dependencies)
local on_final

-- Move the job to `new` if the table allows it; returns true when it moved (or was there).
local function job_move(jk, evk, jid, new, ts, reason)
  local old = redis.call('HGET', jk, 'state')
  if old == new then return true end
  if not allowed(JOB_MOVES, old, new) then return false end
  redis.call('HSET', jk, 'state', new)
  if new == 'running' and redis.call('HEXISTS', jk, 'started_s') == 0 then
    redis.call('HSET', jk, 'started_s', ts)
  end
  if FINAL[new] then
    redis.call('HSET', jk, 'finished_s', ts)
    -- the job's records are trimmed to its summary once FARM_JOB_RETENTION_S has passed
    redis.call('ZADD', keys.JOBS_ENDED, ts, jid)
  end
  if reason ~= '' then redis.call('HSET', jk, 'reason', reason) end
  local fields = {{'type', 'job_state', 'job_id', jid, 'ts', ts, 'state', new, 'message', reason, 'v', '1'}}
  event(evk, fields)
  project_event(jk, fields)
  if FINAL[new] then
    notify(jk, jid, 'job.' .. new, ts, '', reason)
    on_final(jid, new, ts)
  end
  return true
end

local function tile_move(tk, tile, new)
  local old = redis.call('HGET', tk, tile)
  if not allowed(TILE_MOVES, old, new) then
    return redis.error_reply('illegal tile transition ' .. tostring(old) .. ' -> ' .. new)
  end
  redis.call('HSET', tk, tile, new)
end

local function tile_event(evk, jid, ts, state, frame, index, attempt, message)
  event(evk, {{'type', 'tile_state', 'job_id', jid, 'ts', ts, 'state', state, 'frame', frame,
         'tile', index, 'attempt', attempt, 'message', message, 'v', '1'}})
end

-- A job that ends (failed, canceled) takes its unfinished tiles with it, in the step that ends
-- it: each queued or rendering tile is canceled and leaves the sweep's indexes, so none stays
-- 'rendering' for a worker that is gone and the sweep never looks at it again. Every script
-- that moves a job to failed or canceled calls this. (A retry of a failed job queues them again.)
local function end_tiles(jid)
  local tk = keys.tiles(jid)
  local all = redis.call('HGETALL', tk)
  for i = 1, #all, 2 do
    local name, value = all[i], all[i + 1]
    if value == 'queued' or value == 'rendering' then
      tile_move(tk, name, 'canceled')
      redis.call('HDEL', tk, name .. ':d')
      redis.call('ZREM', TILE_DEADLINES, jid .. '|' .. name)
      redis.call('ZREM', REQUEUED, jid .. '|' .. name)
    end
  end
end
{DEPENDENCIES_LUA}
"""

# KEYS: job   ARGV: jid, ts
# A job accepted as waiting (in the transaction that creates it) is linked to its dependencies:
# 'waiting', 'released' (all done already) or 'failed' (one failed, was canceled or is gone).
LINK_DEPENDENCIES = (
    PRELUDE
    + """
if redis.call('HGET', KEYS[1], 'state') ~= 'waiting' then return 'not_waiting' end
return check_waiting(ARGV[1], ARGV[2])
"""
)

# ARGV: ts, limit
# The sweep's pass over waiting jobs: each is counted again (a move that was lost, a dependency
# trimmed away), and one no longer waiting leaves the index. Returns how many were released or
# failed.
RECHECK_WAITING = (
    PRELUDE
    + """
local moved = 0
for _, jid in ipairs(redis.call('ZRANGE', keys.WAITING, 0, tonumber(ARGV[2]) - 1)) do
  if redis.call('HGET', keys.job(jid), 'state') ~= 'waiting' then
    redis.call('ZREM', keys.WAITING, jid)
  elseif check_waiting(jid, ARGV[1]) ~= 'waiting' then
    moved = moved + 1
  end
end
return moved
"""
)

# KEYS: job, tiles, events   ARGV: jid, frame, index, attempt, ts, deadline[, record field,
# record]: the worker's start record of the attempt (farm.taskrecords), written beside the
# tile's state once the tile is this attempt's, in the same step
START_TILE = (
    PRELUDE
    + """
local st = redis.call('HGET', KEYS[1], 'state')
if not st then return 'no_job' end
if FINAL[st] then return 'job_' .. st end
-- a waiting job's tiles are pushed when it is released; a copy found early is not started
if st == 'waiting' then return 'job_waiting' end
local tile = ARGV[2] .. ':' .. ARGV[3]
if redis.call('HGET', KEYS[2], tile) ~= 'queued' or redis.call('HGET', KEYS[2], tile .. ':a') ~= ARGV[4] then
  return 'stale'
end
-- the worker that took it has come to it (farm.queue's mark_taken)
redis.call('HDEL', KEYS[2], tile .. ':t')
if st == 'suspended' then
  -- held back, not started, no failure counted: resuming queues it under the next attempt
  -- (a fresh rq task; this one may still be in rq's hands)
  local held = tonumber(ARGV[4]) + 1
  redis.call('HSET', KEYS[2], tile .. ':a', held, tile .. ':h', held)
  redis.call('ZREM', REQUEUED, ARGV[1] .. '|' .. tile)
  tile_event(KEYS[3], ARGV[1], ARGV[5], 'queued', ARGV[2], ARGV[3], held, 'held: the job is suspended')
  return 'job_suspended'
end
tile_move(KEYS[2], tile, 'rendering')
redis.call('HSET', KEYS[2], tile .. ':d', ARGV[6])
if ARGV[7] then redis.call('HSET', KEYS[2], ARGV[7], ARGV[8]) end
redis.call('ZADD', TILE_DEADLINES, ARGV[6], ARGV[1] .. '|' .. tile)
redis.call('ZREM', REQUEUED, ARGV[1] .. '|' .. tile)
if st == 'queued' then job_move(KEYS[1], KEYS[3], ARGV[1], 'running', ARGV[5], '') end
tile_event(KEYS[3], ARGV[1], ARGV[5], 'rendering', ARGV[2], ARGV[3], ARGV[4], '')
return 'ok'
"""
)

# KEYS: tiles   ARGV: tile, attempt, deadline, job id
TOUCH_TILE = f"""
if redis.call('HGET', KEYS[1], ARGV[1]) ~= 'rendering' or redis.call('HGET', KEYS[1], ARGV[1] .. ':a') ~= ARGV[2] then
  return 0
end
redis.call('HSET', KEYS[1], ARGV[1] .. ':d', ARGV[3])
redis.call('ZADD', '{keys.TILE_DEADLINES}', ARGV[3], ARGV[4] .. '|' .. ARGV[1])
return 1
"""

# KEYS: job, tiles, framecount, assembling, events
# ARGV: jid, frame, index, attempt, ts, tiles_per_frame, assembly_deadline, lease id ('' none),
#       lease token
# The lease check is the allocator's fence: a holder paused past its lease cannot commit.
FINISH_TILE = (
    PRELUDE
    + """
local tile = ARGV[2] .. ':' .. ARGV[3]
local was = redis.call('HGET', KEYS[2], tile)
if was == 'done' and redis.call('HGET', KEYS[2], tile .. ':a') == ARGV[4] then
  -- the same commit again (its reply was lost to a Redis restart and the client retried):
  -- answer as the first time, so a frame's last tile still gets its assembly queued
  if redis.call('HEXISTS', KEYS[4], ARGV[2]) == 1 then return 'frame_ready' end
  return 'ok'
end
if was == 'canceled' and redis.call('HGET', KEYS[2], tile .. ':a') == ARGV[4] then
  -- its job ended while it rendered (end_tiles): nothing commits, the worker is told why
  return 'job_' .. redis.call('HGET', KEYS[1], 'state')
end
if was ~= 'rendering' or redis.call('HGET', KEYS[2], tile .. ':a') ~= ARGV[4] then
  return 'stale'
end
if ARGV[8] ~= '' then
  local l = redis.call('HMGET', keys.lease(ARGV[8]), 'token', 'expires')
  local t = redis.call('TIME')
  local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  if l[1] ~= ARGV[9] or tonumber(l[2]) < now_ms then return 'fenced' end
end
local st = redis.call('HGET', KEYS[1], 'state')
if FINAL[st] then
  if st == 'canceled' then tile_move(KEYS[2], tile, 'canceled') end
  return 'job_' .. st
end
tile_move(KEYS[2], tile, 'done')
redis.call('HDEL', KEYS[2], tile .. ':d')
redis.call('ZREM', TILE_DEADLINES, ARGV[1] .. '|' .. tile)
local done = redis.call('HINCRBY', KEYS[1], 'tiles_done', 1)
tile_event(KEYS[5], ARGV[1], ARGV[5], 'done', ARGV[2], ARGV[3], ARGV[4], '')
local result = 'ok'
if redis.call('HINCRBY', KEYS[3], ARGV[2], 1) == tonumber(ARGV[6]) then
  -- offered as assembly attempt 1 (the rq task's attempt; see CLAIM_FRAME), or above every
  -- attempt of an earlier assembly of a requeued frame, so none of those can claim it
  local fa = tonumber(redis.call('HGET', KEYS[4], ARGV[2] .. ':last') or '0') + 1
  redis.call('HSET', KEYS[4], ARGV[2], ARGV[7], ARGV[2] .. ':a', fa)
  redis.call('ZADD', FRAME_DEADLINES, ARGV[7], ARGV[1] .. '|' .. ARGV[2])
  result = 'frame_ready'
end
if done == tonumber(redis.call('HGET', KEYS[1], 'tiles_total')) then
  job_move(KEYS[1], KEYS[5], ARGV[1], 'assembling', ARGV[5], '')
end
return result
"""
)

# KEYS: job, tiles, events
# ARGV: jid, frame, index, attempt, ts, reason, max_attempts, counts ('1' a failure, '0' a requeue)
# Returns {'retry', new_attempt} | {'failed', attempt} | {'stale'} | {'job_<state>'}
FAIL_TILE = (
    PRELUDE
    + """
local tile = ARGV[2] .. ':' .. ARGV[3]
local was = redis.call('HGET', KEYS[2], tile)
if was == 'canceled' and redis.call('HGET', KEYS[2], tile .. ':a') == ARGV[4] then
  return {'job_' .. redis.call('HGET', KEYS[1], 'state')}
end
if was ~= 'rendering' or redis.call('HGET', KEYS[2], tile .. ':a') ~= ARGV[4] then
  return {'stale'}
end
local st = redis.call('HGET', KEYS[1], 'state')
if FINAL[st] then
  if st == 'canceled' then tile_move(KEYS[2], tile, 'canceled') end
  return {'job_' .. st}
end
local failures = tonumber(redis.call('HGET', KEYS[2], tile .. ':f') or '0')
if ARGV[8] == '1' then
  failures = redis.call('HINCRBY', KEYS[2], tile .. ':f', 1)
  redis.call('HINCRBY', KEYS[1], 'tile_failures', 1)
end
redis.call('HDEL', KEYS[2], tile .. ':d')
redis.call('ZREM', TILE_DEADLINES, ARGV[1] .. '|' .. tile)
if failures < tonumber(ARGV[7]) then
  local next_attempt = tonumber(ARGV[4]) + 1
  tile_move(KEYS[2], tile, 'queued')
  redis.call('HSET', KEYS[2], tile .. ':a', next_attempt)
  -- until the caller confirms its push to the queue, the sweep may push it (a crash between)
  redis.call('ZADD', REQUEUED, ARGV[5], ARGV[1] .. '|' .. tile)
  tile_event(KEYS[3], ARGV[1], ARGV[5], 'queued', ARGV[2], ARGV[3], next_attempt, ARGV[6])
  return {'retry', next_attempt}
end
tile_move(KEYS[2], tile, 'failed')
tile_event(KEYS[3], ARGV[1], ARGV[5], 'failed', ARGV[2], ARGV[3], ARGV[4], ARGV[6])
local why = 'frame ' .. ARGV[2] .. ' tile ' .. ARGV[3] .. ' failed after ' .. failures .. ' attempt(s): ' .. ARGV[6]
job_move(KEYS[1], KEYS[3], ARGV[1], 'failed', ARGV[5], why)
end_tiles(ARGV[1])
return {'failed', ARGV[4]}
"""
)

# KEYS: job, assembling, events   ARGV: jid, frame, ts, assembly attempt
FINISH_FRAME = (
    PRELUDE
    + """
if redis.call('HGET', KEYS[2], ARGV[2] .. ':a') ~= ARGV[4] then return 'stale' end
redis.call('HDEL', KEYS[2], ARGV[2], ARGV[2] .. ':a')
redis.call('HSET', KEYS[2], ARGV[2] .. ':last', ARGV[4])
redis.call('ZREM', FRAME_DEADLINES, ARGV[1] .. '|' .. ARGV[2])
local st = redis.call('HGET', KEYS[1], 'state')
if FINAL[st] then return 'job_' .. st end
local done = redis.call('HINCRBY', KEYS[1], 'frames_done', 1)
redis.call('HSET', KEYS[2], ARGV[2] .. ':c', 1)
local fields = {'type', 'frame_done', 'job_id', ARGV[1], 'ts', ARGV[3], 'frame', ARGV[2], 'v', '1'}
event(KEYS[3], fields)
project_event(KEYS[1], fields)
notify(KEYS[1], ARGV[1], 'frame.done', ARGV[3], ARGV[2], '')
if done == tonumber(redis.call('HGET', KEYS[1], 'frames_total')) then
  job_move(KEYS[1], KEYS[3], ARGV[1], 'done', ARGV[3], '')
end
return 'ok'
"""
)

# KEYS: job, assembling   ARGV: frame, deadline, job id, assembly attempt, now
# An assembler claims or renews its frame: the assembly's lease, fenced by its attempt. The
# sweep re-offers a frame whose deadline passed under the next attempt (a new rq task), so an
# assembler paused past its lease can neither renew nor deliver (FENCE_FRAME) again.
CLAIM_FRAME = (
    PRELUDE
    + """
if FINAL[redis.call('HGET', KEYS[1], 'state') or 'done'] then return 0 end
if redis.call('HGET', KEYS[2], ARGV[1] .. ':a') ~= ARGV[4] then return 0 end
if tonumber(redis.call('HGET', KEYS[2], ARGV[1])) < tonumber(ARGV[5]) then return 0 end
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
redis.call('ZADD', FRAME_DEADLINES, ARGV[2], ARGV[3] .. '|' .. ARGV[1])
return 1
"""
)

# KEYS: job, assembling   ARGV: frame, assembly attempt, now
# Checked right before each of a frame's files is renamed or put into the output, and before
# the manifest: 1 while this attempt's assembly lease holds and the job runs, else 0.
FENCE_FRAME = (
    PRELUDE
    + """
if FINAL[redis.call('HGET', KEYS[1], 'state') or 'done'] then return 0 end
if redis.call('HGET', KEYS[2], ARGV[1] .. ':a') ~= ARGV[2] then return 0 end
if tonumber(redis.call('HGET', KEYS[2], ARGV[1])) < tonumber(ARGV[3]) then return 0 end
return 1
"""
)

# KEYS: job, tiles, events   ARGV: jid, new_state, ts, reason
# Cancel or fail a whole job; its queued and rendering tiles are canceled with it.
END_JOB = (
    PRELUDE
    + """
local st = redis.call('HGET', KEYS[1], 'state')
if not st then return 'no_job' end
if FINAL[st] then return 'job_' .. st end
if not job_move(KEYS[1], KEYS[3], ARGV[1], ARGV[2], ARGV[3], ARGV[4]) then
  return 'job_' .. redis.call('HGET', KEYS[1], 'state')
end
end_tiles(ARGV[1])
return 'ok'
"""
)

# KEYS: job, tiles, events   ARGV: jid, ts
# The user retries a failed job: every tile not done is queued again with a fresh attempt and
# its failures forgotten, and the job runs again. Returns {'ok', frame, index, attempt, ...},
# {'nothing'} when no tile is left to render, or {'job_<state>'} when the job has not failed.
RETRY_FAILED = (
    PRELUDE
    + """
local st = redis.call('HGET', KEYS[1], 'state')
if not st then return {'no_job'} end
if st ~= 'failed' then return {'job_' .. st} end
local out = {'ok'}
local all = redis.call('HGETALL', KEYS[2])
for i = 1, #all, 2 do
  local name, value = all[i], all[i + 1]
  local _, colons = string.gsub(name, ':', '')
  if colons == 1 and value ~= 'done' then
    local attempt = tonumber(redis.call('HGET', KEYS[2], name .. ':a') or '0') + 1
    -- failed, canceled with the job (end_tiles), or left from before end_tiles existed
    if value ~= 'queued' then tile_move(KEYS[2], name, 'queued') end
    redis.call('HSET', KEYS[2], name .. ':a', attempt)
    redis.call('HDEL', KEYS[2], name .. ':f', name .. ':d')
    redis.call('ZADD', REQUEUED, ARGV[2], ARGV[1] .. '|' .. name)
    local sep = string.find(name, ':')
    local frame, index = string.sub(name, 1, sep - 1), string.sub(name, sep + 1)
    tile_event(KEYS[3], ARGV[1], ARGV[2], 'queued', frame, index, attempt, 'retried by the user')
    table.insert(out, frame); table.insert(out, index); table.insert(out, tostring(attempt))
  end
end
if #out == 1 then return {'nothing'} end
redis.call('HSET', KEYS[1], 'reason', '')
redis.call('HDEL', KEYS[1], 'finished_s')
redis.call('ZREM', keys.JOBS_ENDED, ARGV[1])
job_move(KEYS[1], KEYS[3], ARGV[1], 'running', ARGV[2], '')
return out
"""
)

# KEYS: the sweeper's lease   ARGV: sweeper name, now (epoch s), lease_ms, limit,
#       assembly deadline, requeue grace (s)
# The farm's one recovery sweep, run by whichever worker holds the sweeper's lease (the others
# get {'follower'} at the cost of one read). Its work is what expired since the last sweep:
# rendering tiles whose lease deadline passed (requeued, or failing their job once out of
# attempts), frame assemblies past their deadline (offered again), and requeued tiles whose push
# to the queue was never confirmed (checked against the queue by the caller, and named by every
# sweep until it confirms them: a push that failed is tried again).
# Returns {'leader', 't', job, frame, index, attempt, ..., 'f', job, frame, attempt, ..., 'p', job, frame,
# index, attempt, ...}.
SWEEP = (
    PRELUDE
    + """
local holder = redis.call('GET', KEYS[1])
if holder and holder ~= ARGV[1] then return {'follower'} end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[3])
local now, limit = tonumber(ARGV[2]), tonumber(ARGV[4])
local out = {'leader'}
local function split(text, sep)
  local at = string.find(text, sep, 1, true)
  return string.sub(text, 1, at - 1), string.sub(text, at + 1)
end
local function attempts_of(jk)
  local spec = cjson.decode(redis.call('HGET', jk, 'spec') or '{}')
  return tonumber(spec['max_attempts'] or 3)
end
-- queued again under ``attempt`` (a fresh rq task the worker pushes, confirmed by REQUEUED)
local function requeue(member, jid, evk, frame, index, attempt, why)
  redis.call('ZADD', REQUEUED, now, member)
  tile_event(evk, jid, ARGV[2], 'queued', frame, index, attempt, why)
  for _, v in ipairs({'t', jid, frame, index, tostring(attempt)}) do table.insert(out, v) end
end
for _, member in ipairs(redis.call('ZRANGEBYSCORE', TILE_DEADLINES, '-inf', '(' .. now,
                                   'LIMIT', 0, limit)) do
  redis.call('ZREM', TILE_DEADLINES, member)
  local jid, name = split(member, '|')
  local frame, index = split(name, ':')
  local jk = keys.job(jid)
  local tk, evk = keys.tiles(jid), keys.events(jid)
  local st = redis.call('HGET', jk, 'state')
  local tile_st, taken = redis.call('HGET', tk, name), redis.call('HGET', tk, name .. ':t')
  if taken and tile_st == 'queued' and redis.call('HGET', tk, name .. ':a') == taken
     and (st == 'queued' or st == 'running' or st == 'suspended') then
    -- taken from the queue by a worker that never started it (it died in between): queued
    -- again under the next attempt, no failure counted; a suspended job's is held back for
    -- its resume, as START_TILE holds one
    local next_attempt = tonumber(taken) + 1
    redis.call('HDEL', tk, name .. ':t')
    redis.call('HSET', tk, name .. ':a', next_attempt)
    if st == 'suspended' then
      redis.call('HSET', tk, name .. ':h', next_attempt)
      tile_event(evk, jid, ARGV[2], 'queued', frame, index, next_attempt,
                 'held: the job is suspended')
    else
      requeue(member, jid, evk, frame, index, next_attempt,
              'the worker that took it stopped before starting it')
    end
  elseif st and not FINAL[st] and tile_st == 'rendering' then
    local deadline = tonumber(redis.call('HGET', tk, name .. ':d') or '0')
    if deadline >= now then
      redis.call('ZADD', TILE_DEADLINES, deadline, member)
    else
      local attempt = tonumber(redis.call('HGET', tk, name .. ':a'))
      local failures = redis.call('HINCRBY', tk, name .. ':f', 1)
      redis.call('HINCRBY', jk, 'tile_failures', 1)
      redis.call('HDEL', tk, name .. ':d')
      local why = 'the worker rendering it stopped answering'
      if failures < attempts_of(jk) then
        tile_move(tk, name, 'queued')
        redis.call('HSET', tk, name .. ':a', attempt + 1)
        requeue(member, jid, evk, frame, index, attempt + 1, why)
      else
        tile_move(tk, name, 'failed')
        tile_event(evk, jid, ARGV[2], 'failed', frame, index, attempt, why)
        job_move(jk, evk, jid, 'failed', ARGV[2],
          'frame ' .. frame .. ' tile ' .. index .. ' failed after ' .. failures .. ' attempt(s): ' .. why)
        end_tiles(jid)
      end
    end
  end
end
for _, member in ipairs(redis.call('ZRANGEBYSCORE', FRAME_DEADLINES, '-inf', '(' .. now,
                                   'LIMIT', 0, limit)) do
  local jid, frame = split(member, '|')
  local jk = keys.job(jid)
  local ak = keys.assembling(jid)
  local st = redis.call('HGET', jk, 'state')
  local deadline = redis.call('HGET', ak, frame)
  if not st or FINAL[st] or not deadline then
    redis.call('ZREM', FRAME_DEADLINES, member)
  elseif tonumber(deadline) >= now then
    redis.call('ZADD', FRAME_DEADLINES, deadline, member)
  else
    -- offered again under the next attempt: the late assembler's lease is fenced off
    local attempt = redis.call('HINCRBY', ak, frame .. ':a', 1)
    redis.call('HSET', ak, frame, ARGV[5])
    redis.call('ZADD', FRAME_DEADLINES, ARGV[5], member)
    for _, v in ipairs({'f', jid, frame, tostring(attempt)}) do table.insert(out, v) end
  end
end
for _, member in ipairs(redis.call('ZRANGEBYSCORE', REQUEUED, '-inf',
                                   '(' .. (now - tonumber(ARGV[6])), 'LIMIT', 0, limit)) do
  local jid, name = split(member, '|')
  local tk = keys.tiles(jid)
  local st = redis.call('HGET', keys.job(jid), 'state')
  if st and not FINAL[st] and redis.call('HGET', tk, name) == 'queued' then
    local frame, index = split(name, ':')
    for _, v in ipairs({'p', jid, frame, index, redis.call('HGET', tk, name .. ':a')}) do
      table.insert(out, v)
    end
  else
    redis.call('ZREM', REQUEUED, member)
  end
end
return out
"""
)

# ARGV: cutoff (epoch s), limit, now
# Trim jobs that ended before the cutoff to their summary: the job's hash (spec with its
# output, state, reason, times, counters) and its place in the job indexes stay; its tiles,
# frame counts, assemblies, events and delivery records go (the delivery records are in the
# output's manifest.json). At most `limit` jobs a call, the oldest first: the work is what
# expired, never the history. Returns how many jobs were trimmed.
TRIM_ENDED = (
    PRELUDE
    + """
local trimmed = 0
for _, jid in ipairs(redis.call('ZRANGEBYSCORE', keys.JOBS_ENDED, '-inf', ARGV[1],
                                'LIMIT', 0, tonumber(ARGV[2]))) do
  redis.call('ZREM', keys.JOBS_ENDED, jid)
  local jk = keys.job(jid)
  if FINAL[redis.call('HGET', jk, 'state') or ''] then
    for _, name in ipairs(redis.call('HKEYS', keys.blocklist(jid))) do
      redis.call('SREM', keys.worker_blocked(name), jid)
    end
    redis.call('DEL', keys.tiles(jid), keys.frame_counts(jid), keys.assembling(jid),
               keys.events(jid), keys.delivered(jid), keys.dependents(jid), keys.blocklist(jid))
    redis.call('HSET', jk, 'trimmed_s', ARGV[3])
    trimmed = trimmed + 1
  end
end
return trimmed
"""
)

#: every script above as one Redis function library (farm.luafunctions): the prelude is defined
#: once when the library loads, not on every call. Each script's text stays above as the
#: prelude and its body (the same code for a server without functions).
LIBRARY = Library(
    "jobs",
    PRELUDE,
    {
        name.lower(): script.removeprefix(PRELUDE)
        for name, script in {
            "START_TILE": START_TILE, "TOUCH_TILE": TOUCH_TILE, "FINISH_TILE": FINISH_TILE,
            "FAIL_TILE": FAIL_TILE, "FINISH_FRAME": FINISH_FRAME, "CLAIM_FRAME": CLAIM_FRAME,
            "FENCE_FRAME": FENCE_FRAME, "END_JOB": END_JOB, "RETRY_FAILED": RETRY_FAILED,
            "SWEEP": SWEEP, "TRIM_ENDED": TRIM_ENDED,
        }.items()
    },
)  # fmt: skip
