"""The shm backend's tests. PATHS: where a group's calls run (COLLECTIVES_SHM_PATH); the fault
tests run on both, the native path (C++, the default) and the Python one (the reference)."""

PATHS = ["native", "python"]
