"""The Arrow IPC format: the format object (:mod:`.format`, which registers it), its writer,
reader, stream and the bounded IPC reading they share."""

__all__: list[str] = []  # the modules: format (registered), writer, reader, stream
