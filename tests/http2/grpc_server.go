// A gRPC server in Go for tests/tests/http2.rs, without generated code: grpc-go
// (Debian's golang-google-grpc-dev, built in GOPATH mode) with a codec that passes
// bytes through, a unary method `poolscope.Test/Sleep` that sleeps the request's
// ASCII number of ms and answers "ok", and `Abort`, which fails with UNAVAILABLE (a
// trailers-only answer). Each call runs on its own goroutine: nothing
// waits for a worker. Its one optional argument N announces a limit of N streams
// per connection (SETTINGS_MAX_CONCURRENT_STREAMS); none otherwise. Prints `port N` once it listens on 127.0.0.1; serves until
// stdin closes, then prints `served S 0 A` (as grpc_server.py: Sleep, Stream, Abort).
package main

import (
	"bufio"
	"context"
	"fmt"
	"net"
	"os"
	"strconv"
	"sync/atomic"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

type rawCodec struct{}

func (rawCodec) Marshal(v interface{}) ([]byte, error) { return v.([]byte), nil }
func (rawCodec) Unmarshal(data []byte, v interface{}) error {
	*(v.(*[]byte)) = append([]byte(nil), data...)
	return nil
}
func (rawCodec) Name() string   { return "raw" }
func (rawCodec) String() string { return "raw" }

var served, aborted int64

func sleep(_ interface{}, ctx context.Context, dec func(interface{}) error, _ grpc.UnaryServerInterceptor) (interface{}, error) {
	var in []byte
	if err := dec(&in); err != nil {
		return nil, err
	}
	ms, _ := strconv.Atoi(string(in))
	time.Sleep(time.Duration(ms) * time.Millisecond)
	atomic.AddInt64(&served, 1)
	return []byte("ok"), nil
}

func abort(_ interface{}, ctx context.Context, dec func(interface{}) error, _ grpc.UnaryServerInterceptor) (interface{}, error) {
	var in []byte
	if err := dec(&in); err != nil {
		return nil, err
	}
	atomic.AddInt64(&aborted, 1)
	return nil, status.Error(codes.Unavailable, "aborted on purpose")
}

func main() {
	listener, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		panic(err)
	}
	options := []grpc.ServerOption{grpc.CustomCodec(rawCodec{})}
	if len(os.Args) > 1 {
		limit, err := strconv.Atoi(os.Args[1])
		if err != nil {
			panic(err)
		}
		options = append(options, grpc.MaxConcurrentStreams(uint32(limit)))
	}
	server := grpc.NewServer(options...)
	server.RegisterService(&grpc.ServiceDesc{
		ServiceName: "poolscope.Test",
		HandlerType: (*interface{})(nil),
		Methods: []grpc.MethodDesc{
			{MethodName: "Sleep", Handler: sleep},
			{MethodName: "Abort", Handler: abort},
		},
	}, struct{}{})
	fmt.Printf("port %d\n", listener.Addr().(*net.TCPAddr).Port)
	go server.Serve(listener)
	bufio.NewReader(os.Stdin).ReadString('\n')
	server.GracefulStop()
	fmt.Printf("served %d 0 %d\n", atomic.LoadInt64(&served), atomic.LoadInt64(&aborted))
}
