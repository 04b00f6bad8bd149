"""Ways a worker's gradients reach the coordinator besides inline gRPC payloads (`shm`)."""
