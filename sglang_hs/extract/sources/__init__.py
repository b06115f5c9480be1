"""Where a run's samples come from.

  dataset_file.py  the records of --data this run takes (its shard, its node's), prepared for the server's
                   model: the tokenizer, chat template and loss masks of sglang_hs/extract/dataset.py
  server.py        a running server those samples are sent to (Extraction): each request's record comes back
                   through the transport and goes to the sink stage (writer.py)
  launch.py        the server a --data run starts itself when no --server is given, and stops
The records a harvesting server captures from its own traffic, and those its dump holds already, are the
other source: sglang_hs/extract/harvest.py (--from-dump).
"""
