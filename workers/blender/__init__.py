"""The Blender child process: the one package that imports bpy."""
