"""Layer 5: samples by id and streams by position: the `Dataset`/`Stream` protocols,
`TokenWindows`, `TableRows`, `OrderedStream`, `Mixture`."""
