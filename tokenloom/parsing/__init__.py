"""What parser plugins are built from, as ``layers`` is what model plugins are built from: the
streaming base classes and helpers behind tokenloom's own tool and reasoning parsers, which
``tokenloom.plugin_api`` exports. Importing this package registers nothing."""
