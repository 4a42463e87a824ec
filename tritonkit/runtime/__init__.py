"""Running Triton: the embedded server process, its backend dir, the stub watchdog the launcher and the container
supervisor share, the preflight before `make serve`, and the GPU view of the repository.

Imported by the container's supervisor on the NGC image's Python: keep this package free of eager imports."""
