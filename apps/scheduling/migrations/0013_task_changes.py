"""Every change to a task that a scheduling cycle decides on is stamped with the id of the transaction that made
it, so a cycle can read only the rows changed since its last (apps.scheduling.resident).

The column is the database's alone (not on the model): Django never writes it, so a save of a stale instance
cannot put an older stamp back. The trigger stamps an insert, and an update that changes what the engine sees
of a task (its state, compute resource, pool, size, sharing, priority, time limit, times) or the reason code it
shows."""

from django.db import migrations

TRACKED = (
    "state",
    "compute_resource_id",
    "pool_id",
    "size_units",
    "sharing",
    "priority",
    "time_limit_seconds",
    "submitted_at",
    "placed_at",
    "started_at",
    "reason_code",
)
CHANGED = " OR ".join(f"OLD.{column} IS DISTINCT FROM NEW.{column}" for column in TRACKED)

FORWARD = f"""
ALTER TABLE scheduling_task ADD COLUMN changed_xid bigint NOT NULL DEFAULT 0;
CREATE INDEX scheduling_task_changed_xid ON scheduling_task (changed_xid);
CREATE FUNCTION scheduling_task_stamp() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    NEW.changed_xid := pg_current_xact_id()::text::bigint;
    RETURN NEW;
END
$$;
CREATE TRIGGER scheduling_task_stamp_insert BEFORE INSERT ON scheduling_task
    FOR EACH ROW EXECUTE FUNCTION scheduling_task_stamp();
CREATE TRIGGER scheduling_task_stamp_update BEFORE UPDATE ON scheduling_task
    FOR EACH ROW WHEN ({CHANGED}) EXECUTE FUNCTION scheduling_task_stamp();
"""

BACKWARD = """
DROP TRIGGER scheduling_task_stamp_update ON scheduling_task;
DROP TRIGGER scheduling_task_stamp_insert ON scheduling_task;
DROP FUNCTION scheduling_task_stamp();
ALTER TABLE scheduling_task DROP COLUMN changed_xid;
"""


class Migration(migrations.Migration):
    dependencies = [
        ("scheduling", "0012_objective_samples"),
    ]

    operations = [migrations.RunSQL(FORWARD, BACKWARD)]
