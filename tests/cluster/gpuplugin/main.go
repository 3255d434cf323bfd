// Command gpuplugin is the test node's GPU device plugin (kubelet device plugin API
// v1beta1). It advertises simulated nvidia.com/gpu devices, and for each allocation it
// gives the container what the NVIDIA plugin and runtime would: a libnvidia-ml.so.1 (the
// tests' simulated NVML), a GPU file naming exactly the allocated GPUs, and a device node
// /dev/nvidiaN per GPU (a stand-in: the host's /dev/null), so the agent's NVML reader and
// its PID mapping run unchanged inside a real container.
//
//	gpuplugin -gpus 8 -nvml-lib DIR -state DIR [-plugin-dir /var/lib/kubelet/device-plugins]
//
// Each allocation's GPU file is STATE/alloc-I-J.../gpus (I, J: the GPU indexes), mounted
// read-only at /run/devbox-sim-gpus in the container; tests add `proc` lines to it (a new
// file renamed over the old) to put a process on a GPU.
package main

import (
	"context"
	"flag"
	"fmt"
	"log"
	"net"
	"os"
	"os/signal"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	pluginapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"
)

const (
	socketName = "devbox-sim-gpu.sock"
	// In the container: where the library and the GPU file appear.
	libInContainer  = "/usr/local/nvidia/lib64"
	gpusInContainer = "/run/devbox-sim-gpus"
)

type plugin struct {
	pluginapi.UnimplementedDevicePluginServer
	gpus    int
	nvmlLib string
	state   string
	prefix  string
}

func deviceID(i int) string { return fmt.Sprintf("gpu%d", i) }

func (p *plugin) uuid(i int) string { return fmt.Sprintf("GPU-%s-%04d", p.prefix, i) }

func (p *plugin) GetDevicePluginOptions(context.Context, *pluginapi.Empty) (*pluginapi.DevicePluginOptions, error) {
	return &pluginapi.DevicePluginOptions{}, nil
}

func (p *plugin) ListAndWatch(_ *pluginapi.Empty, stream pluginapi.DevicePlugin_ListAndWatchServer) error {
	devices := make([]*pluginapi.Device, 0, p.gpus)
	for i := 0; i < p.gpus; i++ {
		devices = append(devices, &pluginapi.Device{ID: deviceID(i), Health: pluginapi.Healthy})
	}
	if err := stream.Send(&pluginapi.ListAndWatchResponse{Devices: devices}); err != nil {
		return err
	}
	// The simulated GPUs never fail: nothing more to report until the kubelet hangs up.
	<-stream.Context().Done()
	return nil
}

func (p *plugin) Allocate(_ context.Context, req *pluginapi.AllocateRequest) (*pluginapi.AllocateResponse, error) {
	resp := &pluginapi.AllocateResponse{}
	for _, creq := range req.ContainerRequests {
		indexes := make([]int, 0, len(creq.DevicesIds))
		for _, id := range creq.DevicesIds {
			i, err := strconv.Atoi(strings.TrimPrefix(id, "gpu"))
			if err != nil || i < 0 || i >= p.gpus {
				return nil, fmt.Errorf("unknown device %q", id)
			}
			indexes = append(indexes, i)
		}
		sort.Ints(indexes)
		words := make([]string, len(indexes))
		uuids := make([]string, len(indexes))
		var lines strings.Builder
		for n, i := range indexes {
			words[n] = strconv.Itoa(i)
			uuids[n] = p.uuid(i)
			fmt.Fprintf(&lines, "gpu uuid=%s name=Simulated_H100 mem_total=%d power_limit_mw=700000 minor=%d\n",
				p.uuid(i), int64(80)<<30, i)
		}
		dir := filepath.Join(p.state, "alloc-"+strings.Join(words, "-"))
		if err := writeAtomically(dir, "gpus", lines.String()); err != nil {
			return nil, err
		}
		car := &pluginapi.ContainerAllocateResponse{
			Envs: map[string]string{
				"DEVBOX_NVML_SIM":        gpusInContainer + "/gpus",
				"LD_LIBRARY_PATH":        libInContainer,
				"NVIDIA_VISIBLE_DEVICES": strings.Join(uuids, ","),
			},
			Mounts: []*pluginapi.Mount{
				{ContainerPath: libInContainer, HostPath: p.nvmlLib, ReadOnly: true},
				{ContainerPath: gpusInContainer, HostPath: dir, ReadOnly: true},
			},
			Devices: []*pluginapi.DeviceSpec{
				{ContainerPath: "/dev/nvidiactl", HostPath: "/dev/null", Permissions: "rw"},
			},
		}
		for _, i := range indexes {
			car.Devices = append(car.Devices, &pluginapi.DeviceSpec{
				ContainerPath: fmt.Sprintf("/dev/nvidia%d", i), HostPath: "/dev/null", Permissions: "rw",
			})
		}
		log.Printf("allocated %v: %s", creq.DevicesIds, dir)
		resp.ContainerResponses = append(resp.ContainerResponses, car)
	}
	return resp, nil
}

func (p *plugin) PreStartContainer(context.Context, *pluginapi.PreStartContainerRequest) (*pluginapi.PreStartContainerResponse, error) {
	return &pluginapi.PreStartContainerResponse{}, nil
}

// writeAtomically replaces dir/name in one rename: a reader never sees half a file.
func writeAtomically(dir, name, text string) error {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	tmp := filepath.Join(dir, "."+name+".tmp")
	if err := os.WriteFile(tmp, []byte(text), 0o644); err != nil {
		return err
	}
	return os.Rename(tmp, filepath.Join(dir, name))
}

// serve listens on the plugin socket and registers with the kubelet; it returns the
// server and the socket's inode, which changes (or vanishes) when the kubelet restarts
// and clears its plugin folder.
func serve(p *plugin, dir, resource string) (*grpc.Server, uint64, error) {
	sock := filepath.Join(dir, socketName)
	_ = os.Remove(sock)
	lis, err := net.Listen("unix", sock)
	if err != nil {
		return nil, 0, err
	}
	server := grpc.NewServer()
	pluginapi.RegisterDevicePluginServer(server, p)
	go func() { _ = server.Serve(lis) }()

	conn, err := grpc.NewClient("unix://"+filepath.Join(dir, "kubelet.sock"),
		grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		server.Stop()
		return nil, 0, err
	}
	defer conn.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	_, err = pluginapi.NewRegistrationClient(conn).Register(ctx, &pluginapi.RegisterRequest{
		Version:      pluginapi.Version,
		Endpoint:     socketName,
		ResourceName: resource,
	})
	if err != nil {
		server.Stop()
		return nil, 0, fmt.Errorf("register with the kubelet: %w", err)
	}
	return server, inode(sock), nil
}

func inode(path string) uint64 {
	var st syscall.Stat_t
	if syscall.Stat(path, &st) != nil {
		return 0
	}
	return st.Ino
}

func main() {
	gpus := flag.Int("gpus", 8, "simulated GPUs to advertise")
	resource := flag.String("resource", "nvidia.com/gpu", "extended resource name")
	dir := flag.String("plugin-dir", pluginapi.DevicePluginPath, "the kubelet's device plugin folder")
	nvmlLib := flag.String("nvml-lib", "", "folder holding the simulated libnvidia-ml.so.1")
	state := flag.String("state", "", "folder for the allocations' GPU files")
	prefix := flag.String("uuid-prefix", "node", "GPU UUIDs are GPU-PREFIX-NNNN")
	flag.Parse()
	if *nvmlLib == "" || *state == "" || *gpus < 1 {
		log.Fatal("usage: gpuplugin -gpus N -nvml-lib DIR -state DIR [-plugin-dir DIR]")
	}
	p := &plugin{gpus: *gpus, nvmlLib: *nvmlLib, state: *state, prefix: *prefix}

	stop := make(chan os.Signal, 1)
	signal.Notify(stop, syscall.SIGINT, syscall.SIGTERM)
	var server *grpc.Server
	var ino uint64
	tick := time.NewTicker(500 * time.Millisecond)
	defer tick.Stop()
	for {
		if server == nil || inode(filepath.Join(*dir, socketName)) != ino {
			if server != nil {
				log.Print("the kubelet cleared the plugin socket; registering again")
				server.Stop()
				server = nil
			}
			var err error
			if server, ino, err = serve(p, *dir, *resource); err != nil {
				log.Printf("not registered yet: %v", err)
				server = nil
			} else {
				log.Printf("registered %d GPUs as %s", *gpus, *resource)
			}
		}
		select {
		case <-stop:
			if server != nil {
				server.Stop()
			}
			_ = os.Remove(filepath.Join(*dir, socketName))
			return
		case <-tick.C:
		}
	}
}
