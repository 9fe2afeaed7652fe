"""The object store behind one interface: a folder or S3 (base, local, s3), which one a URL names
(factory), and where the farm keeps things in it (layout)."""
