"""The contracts between stages: shard schemas, commit records and manifests, fingerprints, storage.

Every writer and reader of every stage imports these; nothing else defines a column name or a file name.
"""
