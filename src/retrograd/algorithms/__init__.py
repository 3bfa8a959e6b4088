"""Pure tensor maths: losses and schedules. Imports only torch; no models, no I/O."""
