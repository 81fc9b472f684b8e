"""The public surface: boxes, processes and files. Re-exported by ``sandlot``."""
