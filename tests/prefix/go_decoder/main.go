// Command go_decoder lets Baton's tests check its KV events and vLLM-compatible block hashes
// against llm-d's own Go code:
//
//   - decode:    reads frames as JSON lines {"topic", "seq_hex", "payload_hex"} on stdin and
//     prints what llm-d-kv-cache's vLLM engine adapter decodes from each, one JSON line each.
//   - subscribe: connects a ZMQ SUB socket (go-zeromq, the library llm-d's own subscriber uses)
//     to -endpoint, prints "ready", then prints each received message decoded by the same
//     adapter, until its stdin is closed.
//   - hash:      reads a JSON array of token ids on stdin and prints the vLLM block keys that
//     llm-d-kv-cache-manager v0.4.0 computes for them (sha256 over canonical CBOR, seeded like
//     vLLM's NONE_HASH from -seed, 64-bit key from the digest's last 8 bytes).
package main

import (
	"bufio"
	"context"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"os"

	zmq4 "github.com/go-zeromq/zmq4"
	"github.com/llm-d/llm-d-kv-cache-manager/pkg/kvcache/kvblock"
	"github.com/llm-d/llm-d-kv-cache/pkg/kvevents"
	"github.com/llm-d/llm-d-kv-cache/pkg/kvevents/engineadapter"
)

type frameIn struct {
	Topic      string `json:"topic"`
	SeqHex     string `json:"seq_hex"`
	PayloadHex string `json:"payload_hex"`
}

type eventOut struct {
	Type  kvevents.EventType    `json:"type"`
	Event kvevents.GenericEvent `json:"event"`
}

type batchOut struct {
	Seq       uint64     `json:"seq"`
	Topic     string     `json:"topic"`
	PodID     string     `json:"pod_id"`
	ModelName string     `json:"model_name"`
	Timestamp float64    `json:"ts"`
	Events    []eventOut `json:"events"`
	Error     string     `json:"error,omitempty"`
}

func decodeMessage(adapter *engineadapter.VLLMAdapter, topic string, seq uint64, payload []byte) batchOut {
	msg := &kvevents.RawMessage{Topic: topic, Sequence: seq, Payload: payload}
	out := batchOut{Seq: seq, Topic: topic, Events: []eventOut{}}
	podID, model, batch, err := adapter.ParseMessage(msg)
	if err != nil {
		out.Error = err.Error()
		return out
	}
	out.PodID, out.ModelName, out.Timestamp = podID, model, batch.Timestamp
	for _, ev := range batch.Events {
		out.Events = append(out.Events, eventOut{Type: ev.Type(), Event: ev})
	}
	return out
}

func runDecode(enc *json.Encoder) error {
	adapter := engineadapter.NewVLLMAdapter()
	scanner := bufio.NewScanner(os.Stdin)
	scanner.Buffer(make([]byte, 1<<20), 64<<20)
	for scanner.Scan() {
		var in frameIn
		if err := json.Unmarshal(scanner.Bytes(), &in); err != nil {
			return fmt.Errorf("bad input line: %w", err)
		}
		seqBytes, err := hex.DecodeString(in.SeqHex)
		if err != nil || len(seqBytes) != 8 {
			return fmt.Errorf("bad seq_hex %q", in.SeqHex)
		}
		payload, err := hex.DecodeString(in.PayloadHex)
		if err != nil {
			return fmt.Errorf("bad payload_hex: %w", err)
		}
		if err := enc.Encode(decodeMessage(adapter, in.Topic, binary.BigEndian.Uint64(seqBytes), payload)); err != nil {
			return err
		}
	}
	return scanner.Err()
}

func runSubscribe(enc *json.Encoder, endpoint, topic string) error {
	adapter := engineadapter.NewVLLMAdapter()
	sub := zmq4.NewSub(context.Background())
	defer sub.Close()
	if err := sub.Dial(endpoint); err != nil {
		return fmt.Errorf("dial %s: %w", endpoint, err)
	}
	if err := sub.SetOption(zmq4.OptionSubscribe, topic); err != nil {
		return err
	}
	go func() {
		// The test closes stdin when it has seen what it needs.
		_, _ = io.Copy(io.Discard, os.Stdin)
		os.Exit(0)
	}()
	fmt.Println("ready")
	for {
		msg, err := sub.Recv()
		if err != nil {
			return err
		}
		if len(msg.Frames) != 3 || len(msg.Frames[1]) != 8 {
			return fmt.Errorf("unexpected message shape: %d frames", len(msg.Frames))
		}
		seq := binary.BigEndian.Uint64(msg.Frames[1])
		if err := enc.Encode(decodeMessage(adapter, string(msg.Frames[0]), seq, msg.Frames[2])); err != nil {
			return err
		}
	}
}

func runHash(enc *json.Encoder, seed string, blockSize int, model string) error {
	var tokens []uint32
	if err := json.NewDecoder(os.Stdin).Decode(&tokens); err != nil {
		return fmt.Errorf("bad token list: %w", err)
	}
	db := kvblock.NewChunkedTokenDatabase(&kvblock.TokenProcessorConfig{BlockSize: blockSize, HashSeed: seed})
	keys := db.TokensToKVBlockKeys(tokens, model)
	hashes := make([]uint64, len(keys))
	for i, k := range keys {
		hashes[i] = k.ChunkHash
	}
	return enc.Encode(hashes)
}

func main() {
	mode := flag.String("mode", "decode", "decode | subscribe | hash")
	endpoint := flag.String("endpoint", "", "subscribe: the PUB endpoint to dial")
	topic := flag.String("topic", "", "subscribe: topic prefix filter")
	seed := flag.String("seed", "", "hash: the seed (vLLM's PYTHONHASHSEED)")
	blockSize := flag.Int("block-size", 16, "hash: tokens per block")
	model := flag.String("model", "m", "hash: model name (not part of the hash)")
	flag.Parse()

	enc := json.NewEncoder(os.Stdout)
	var err error
	switch *mode {
	case "decode":
		err = runDecode(enc)
	case "subscribe":
		err = runSubscribe(enc, *endpoint, *topic)
	case "hash":
		err = runHash(enc, *seed, *blockSize, *model)
	default:
		err = fmt.Errorf("unknown -mode %q", *mode)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "go_decoder:", err)
		os.Exit(1)
	}
}
