"""The vocabulary every layer shares: errors, N-d boxes, atomic files, option records, the
protobuf wire format and thread priority. Imports nothing else of the package."""
