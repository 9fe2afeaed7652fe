"""The webhook outbox: job events a hook may want, appended in the script that makes the event.

The outbox is written by the same Lua script (or MULTI) that moves the job, so an event is in
the outbox exactly when it happened, whatever process dies next; the dispatcher reads it as a
Redis consumer group and acknowledges an entry in the script that creates its deliveries.
Only projects with a hook (``WEBHOOK_PROJECTS``) write entries: a farm without webhooks keeps
nothing here.
"""

from __future__ import annotations

from farm import keys

#: entries the outbox keeps at most (approximately) when no dispatcher reads it (no web runs);
#: older ones are dropped, and with them those notifications
OUTBOX_MAXLEN = 100_000

#: the keys NOTIFY_LUA finds by name
KEYS_NAMES = ("job", "WEBHOOK_OUTBOX", "WEBHOOK_PROJECTS")

#: notify(jk, jid, event, ts, frame, message): append the event to the outbox when the job's
#: project has a hook. Call it after the job's hash holds the state the event reports.
NOTIFY_LUA = f"""
local function notify(jk, jid, kind, ts, frame, message)
  local row = redis.call('HMGET', jk, 'project', 'state', 'frames_done', 'frames_total')
  local project = row[1]
  if not project then
    -- a job created before its hash named its project
    local ok, spec = pcall(cjson.decode, redis.call('HGET', jk, 'spec') or '{{}}')
    project = ok and type(spec['project']) == 'string' and spec['project'] or 'default'
  end
  if redis.call('SISMEMBER', keys.WEBHOOK_PROJECTS, project) == 0 then return end
  redis.call('XADD', keys.WEBHOOK_OUTBOX, 'MAXLEN', '~', {OUTBOX_MAXLEN}, '*',
    'event', kind, 'job_id', jid, 'project', project, 'ts', ts, 'state', row[2] or '',
    'frame', frame, 'message', message, 'frames_done', row[3] or '0',
    'frames_total', row[4] or '0')
end
"""

# ARGV: job id, ts. Run in the MULTI that creates the job, after its hash is written.
SUBMITTED = (
    keys.lua(*KEYS_NAMES)
    + NOTIFY_LUA
    + """
notify(keys.job(ARGV[1]), ARGV[1], 'job.submitted', ARGV[2], '', '')
return 1
"""
)
