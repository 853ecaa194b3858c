"""The trio runtime: real time, real sockets and real processes around the core machines."""
