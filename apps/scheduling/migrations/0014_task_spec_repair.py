"""Tasks whose spec was saved as a JSON string get their spec back.

A run adopted from an agent that came back saved its task whole, and the task had been read by the fleet's
compiled SQL without the ORM's conversion, so its spec was saved as the JSON text of what it was: a string.
A spec is always an object (the API accepts nothing else), so a string that holds an object's JSON is
such a save, and is put back as that object. Nothing else is touched."""

import json
from typing import Any

from django.db import migrations


def repair(apps: Any, schema_editor: Any) -> None:
    with schema_editor.connection.cursor() as cursor:
        cursor.execute("SELECT id, spec #>> '{}' FROM scheduling_task WHERE jsonb_typeof(spec) = 'string'")
        for task_id, text in cursor.fetchall():
            try:
                spec = json.loads(text)
            except ValueError:
                continue
            if isinstance(spec, dict):
                cursor.execute(
                    "UPDATE scheduling_task SET spec = %s::jsonb WHERE id = %s", [json.dumps(spec), task_id]
                )


class Migration(migrations.Migration):
    dependencies = [("scheduling", "0013_task_changes")]

    operations = [migrations.RunPython(repair, migrations.RunPython.noop, elidable=True)]
