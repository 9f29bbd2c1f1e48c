// channel_layout.cuh: what the channel family's kernels share about their
// layouts (channels.cu's header describes them): the LAYOUT codes, a
// call's shape and each statistic group's pivot.
#pragma once
#include "common.cuh"

namespace cunorm {

constexpr int kChannelBlockThreads = 256;  // mirrors CHANNEL_BLOCK_THREADS in cunorm/_engine/dispatch_channels.py
// mirror CHANNELS_FIRST, CHANNELS_LAST, CHANNELS_LAST_GROUPED, CHANNELS_LAST_PAIRED in
// cunorm/_engine/dispatch_channels.py
constexpr int kChannelsFirst = 0;
constexpr int kChannelsLast = 1;
constexpr int kChannelsLastGrouped = 2;
constexpr int kChannelsLastPaired = 3;

// Where a paired thread's vector of channels c0 .. c0 + VEC - 1 is cut: its
// first `split` channels lie in group c0 / channels_per_group, the rest
// (when split < VEC) in the next.
template <int VEC>
__device__ __forceinline__ int paired_split(int c0, int channels_per_group) {
    return min(VEC, (c0 / channels_per_group + 1) * channels_per_group - c0);
}

struct ChannelShape {
    long long batch;
    long long spatial;
    int channels;
    int channels_per_group;
    int groups;
    int per_sample;
};

// Offset of the pivot (first element) of the statistic group of channel c of
// sample n.
template <bool CHANNELS_LAST>
__device__ __forceinline__ long long pivot_offset(const ChannelShape& cs, long long n, int c) {
    const long long first_channel = static_cast<long long>(c / cs.channels_per_group) * cs.channels_per_group;
    const long long sample = cs.per_sample ? n : 0;
    return CHANNELS_LAST ? sample * cs.spatial * cs.channels + first_channel
                         : (sample * cs.channels + first_channel) * cs.spatial;
}

template <class Norm, class A, class T, bool CHANNELS_LAST>
__device__ __forceinline__ A group_pivot(const T* x, const ChannelShape& cs, long long n, int c) {
    if constexpr (!Norm::kShifted) return A(0);
    else return static_cast<A>(widen(x[pivot_offset<CHANNELS_LAST>(cs, n, c)]));
}

__device__ __forceinline__ ChannelShape channel_shape(long long batch, long long spatial, int channels,
                                                      int channels_per_group, int per_sample) {
    return ChannelShape{batch, spatial, channels, channels_per_group, channels / channels_per_group, per_sample};
}

}  // namespace cunorm
