"""The Blender child process, run as ``python -m workers.blender``: the one package that imports
bpy (its ``__main__`` imports it after arming the parent-death signal)."""
